// decode_bench's kernel lab (--gemv-lab, --int-lab): the decode GEMM shapes of Qwen3-8B (q/k/v, o,
// gate/up, down, the LM head) timed alone, no model needed.
#pragma once

namespace kvlm::bench {

// At m = 1-16 each small-m kernel that takes m and cuBLASLt, then cuBLASLt at m = 32, 64 and 256,
// gemv_fp8's kernels and the W8A8 path, each against `bw` (the copy bandwidth, bytes/s);
// int_only: the grouped-code (4- and 8-bit) table alone.
void gemv_lab(double bw, bool int_only);

}  // namespace kvlm::bench
