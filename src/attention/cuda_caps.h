// What the CUDA attention kernels (src/ops/cuda) handle, as a BackendCapabilities
// declaration. No CUDA header: the selector and `kvlm inspect` can read it anywhere.
// cuda_attention_capabilities() (attention/cuda_backend_caps.cpp) is this build's
// declaration, compiled and registered (attention/registry.cpp) in CUDA builds only;
// make_cuda_attention_capabilities() is the pure function behind it, inline here so that
// CPU-only builds can test it for any architecture list.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attention/backend.h"
#include "attention/selector.h"
#include "kv/kv_formats.h"

namespace kvlm {

const BackendCapabilities& cuda_attention_capabilities();

namespace cuda_caps_detail {

// One entry of CMAKE_CUDA_ARCHITECTURES: "80" (SASS + PTX), "90a" (arch-specific),
// "100f" (family-specific), with an optional "-real" (SASS only) or "-virtual" (PTX only).
struct ArchEntry {
  int arch = 0;  // major * 10 + minor
  char suffix = 0;
  bool sass = true, ptx = true;
};

// nullopt when an entry is not of that form ("native", "all", "all-major").
inline std::optional<std::vector<ArchEntry>> parse_archs(std::string_view s) {
  std::vector<ArchEntry> out;
  while (!s.empty()) {
    const size_t cut = s.find_first_of(",;");
    std::string_view e = s.substr(0, cut);
    s = cut == std::string_view::npos ? std::string_view{} : s.substr(cut + 1);
    while (!e.empty() && e.front() == ' ') e.remove_prefix(1);
    while (!e.empty() && e.back() == ' ') e.remove_suffix(1);
    if (e.empty()) continue;
    ArchEntry a;
    if (e.ends_with("-real")) {
      a.ptx = false;
      e.remove_suffix(5);
    } else if (e.ends_with("-virtual")) {
      a.sass = false;
      e.remove_suffix(8);
    }
    if (!e.empty() && (e.back() == 'a' || e.back() == 'f')) {
      a.suffix = e.back();
      e.remove_suffix(1);
    }
    if (e.size() < 2 || e.size() > 3) return std::nullopt;
    for (char c : e) {
      if (c < '0' || c > '9') return std::nullopt;
      a.arch = a.arch * 10 + (c - '0');
    }
    out.push_back(a);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

struct ArchChoice {
  int arch = 0;  // 0: nothing runs
  char suffix = 0;
  bool sass = false;
};

// The code the driver loads on a GPU of compute capability `cc`: the newest compatible SASS
// (same major and minor <= the GPU's; an arch-specific "a" build only on exactly its own
// compute capability), else the newest compatible PTX, JIT-compiled (plain PTX on any later
// GPU; "a" only on its own compute capability, "f" within its major).
inline ArchChoice choose_arch(const std::vector<ArchEntry>& entries, int cc) {
  ArchChoice best;
  for (const auto& e : entries) {
    const bool ok = e.suffix == 'a' ? e.arch == cc : (e.arch / 10 == cc / 10 && e.arch <= cc);
    if (e.sass && ok && e.arch > best.arch) best = {e.arch, e.suffix, true};
  }
  if (best.arch) return best;
  for (const auto& e : entries) {
    const bool ok = e.suffix == 'a' ? e.arch == cc : e.suffix == 'f' ? (e.arch / 10 == cc / 10 && e.arch <= cc) : e.arch <= cc;
    if (e.ptx && ok && e.arch > best.arch) best = {e.arch, e.suffix, false};
  }
  return best;
}

}  // namespace cuda_caps_detail

// The declaration for a build whose device code was compiled for `archs`
// (CMAKE_CUDA_ARCHITECTURES, entries separated by ';' or ','), with the FP8 conversions in
// software on every GPU when `force_software_fp8` (KVLM_FORCE_SOFTWARE_FP8).
//
// Every GPU gets the same formats, head sizes and masks; what differs by the code it runs
// (the architecture the kernels were compiled for, ops/cuda/kv_codec.cuh and gemv.cu):
//  - below sm_89 (sm_80 code, which compute capability 8.0-8.9 run when the build has no
//    sm_89): no FP8 conversion instructions, so the three FP8 formats are decoded and encoded
//    in software, bit-identical to the instructions (tests/cuda checks both against the CPU
//    reference, the software path through a KVLM_FORCE_SOFTWARE_FP8 build on the H200);
//  - below sm_90: no programmatic dependent launch (a speed difference only).
// GPUs the build has no code for (below 8.0; 9.x and up in a build without plain PTX, e.g.
// an sm_90a-only build on Blackwell) are not covered, and the selector says so.
// Architecture lists that are not plain numbers ("native", "all") cannot be resolved here:
// then the tiers follow the GPU's own compute capability, from 8.0 up.
inline BackendCapabilities make_cuda_attention_capabilities(std::string_view archs, bool force_software_fp8) {
  using namespace cuda_caps_detail;
  BackendCapabilities caps{
      .name = "cuda",
      .device = Device::Cuda,
      .kv_formats = kv_formats_of(KVFormatSet::Cuda),
      .kv_pairs = KVFormatSet::Cuda,  // the K != V pairs the kernels are compiled for
      .head_sizes = {8, 16, 32, 64, 128, 256},
      .max_head_size = 256,
      .causal = true,
      .sliding_window = true,
      .non_causal = true,
      .exact_tokens = true,  // the CUDA-core kernel (paged_attention_rows.cuh) reads them
      .attention_sinks = true,  // every kernel's normalization and the split reduction (sink_term)
      .min_compute_capability = 80,
      .priority = 100,  // above cpu (10)
      .description = "paged CUDA kernels: split-KV decode, per-row multi-token path; bf16 queries, fp32 accumulation",
  };
  std::vector<KVStorage> fp8;  // the formats whose codes are FP8
  for (const KVStorage& kv : caps.kv_formats)
    if (kv.storage == DType::F8E4M3 || kv.storage == DType::F8E5M2) fp8.push_back(kv);
  const auto entries = parse_archs(archs);
  bool open_ended = !entries;  // the last tier's code also runs on every later GPU
  auto tier_at = [&](int cc) -> std::optional<ComputeTier> {
    ComputeTier t{.min_cc = cc, .max_cc = cc};
    int code_arch = cc;
    if (entries) {
      const ArchChoice c = choose_arch(*entries, cc);
      if (!c.arch) return std::nullopt;
      code_arch = c.arch;
      const std::string name = std::to_string(c.arch) + (c.suffix ? std::string(1, c.suffix) : "");
      t.code = c.sass ? "sm_" + name : "compute_" + name + " PTX, JIT-compiled by the driver";
      open_ended = !c.sass && c.suffix == 0;
    } else {
      t.code = "the GPU's own code (CMAKE_CUDA_ARCHITECTURES=" + std::string(archs) + ")";
    }
    if (force_software_fp8 || code_arch < 89) {
      t.software_fp8 = fp8;
      t.software_fp8_why = force_software_fp8 ? "a KVLM_FORCE_SOFTWARE_FP8 build"
                                              : "no FP8 conversion instructions before sm_89";
    }
    if (code_arch < 90) t.note = "no programmatic dependent launch";
    return t;
  };
  // Walk the compute capabilities 8.0 ... 12.9 and merge neighbours that run the same way.
  int last = 0;
  for (int major = 8; major <= 12; ++major)
    for (int minor = 0; minor <= 9; ++minor) {
      const int cc = major * 10 + minor;
      auto t = tier_at(cc);
      if (!t) continue;
      auto& ts = caps.compute_tiers;
      if (!ts.empty() && ts.back().max_cc == last && ts.back().code == t->code && ts.back().software_fp8 == t->software_fp8 &&
          ts.back().note == t->note)
        ts.back().max_cc = cc;
      else
        ts.push_back(*t);
      last = cc;
    }
  if (!caps.compute_tiers.empty()) {
    if (open_ended && caps.compute_tiers.back().max_cc == 129) caps.compute_tiers.back().max_cc = 0;
    caps.min_compute_capability = caps.compute_tiers.front().min_cc;
    caps.description += ". By compute capability: " + describe_compute_tiers(caps);
  }
  return caps;
}

}  // namespace kvlm
