// The integer types of every index array that crosses a module boundary.
//
// vLLM shipped a crash because one index array was int64 and its peer int32 (seed 000).
// kvlm names each index kind once, here, and every block table, slot mapping, position and
// token id array in the engine, the kernels and the tests uses these aliases.
#pragma once

#include <cstdint>

namespace kvlm {

using TokenId = int32_t;   // vocabulary index
using Position = int32_t;  // absolute position of a token in its sequence (RoPE, masks)
using BlockId = int32_t;   // index of a KV page in a layer's pool; block tables are BlockId[]
using SlotId = int64_t;    // block * block_size + offset: can exceed 2^31 in big GPU pools

static_assert(sizeof(TokenId) == 4 && sizeof(Position) == 4 && sizeof(BlockId) == 4);
static_assert(sizeof(SlotId) == 8);

}  // namespace kvlm
