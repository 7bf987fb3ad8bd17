#include "io/int4_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/numeric.h"
#include "io/grouped_codes.h"

namespace kvlm {

namespace {

std::string shape_of(const TensorInfo& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void expect(const TensorInfo* t, const std::string& name, std::initializer_list<int64_t> shape, bool int32,
            const std::string& why) {
  if (!t) throw Error("the checkpoint's 4-bit module '" + name.substr(0, name.rfind('.')) + "' has no '" + name + "'");
  const bool dtype_ok = int32 ? t->dtype == DType::I32
                              : (t->dtype == DType::F16 || t->dtype == DType::BF16 || t->dtype == DType::F32);
  if (!dtype_ok)
    throw Error("tensor '" + name + "' has dtype " + std::string(dtype_name(t->dtype)) + "; expected " +
                (int32 ? "int32" : "float16, bfloat16 or float32"));
  if (!std::equal(t->shape.begin(), t->shape.end(), shape.begin(), shape.end()))
    throw Error("tensor '" + name + "' has shape " + shape_of(*t) + "; " + why);
}

int32_t i32_at(const TensorView& v, size_t i) {
  int32_t x;
  std::memcpy(&x, v.bytes.data() + 4 * i, 4);
  return x;
}

float float_at(const TensorView& v, size_t i) {
  switch (v.info->dtype) {
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, v.bytes.data() + 2 * i, 2);
      return num::f16_to_f32(h);
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, v.bytes.data() + 2 * i, 2);
      return num::bf16_to_f32(h);
    }
    default: {
      float f;
      std::memcpy(&f, v.bytes.data() + 4 * i, 4);
      return f;
    }
  }
}

// Nibble j (0-7) of a packed int32.
int nibble(int32_t word, int j) { return int((uint32_t(word) >> (4 * j)) & 0xF); }

}  // namespace

const Int4TensorNames& int4_tensor_names(Int4Scheme::Kind k) {
  static constexpr Int4TensorNames kAwq{"qweight", "qzeros", "scales", "", "", '.', ".weight"};
  static constexpr Int4TensorNames kGptq{"qweight", "qzeros", "scales", "g_idx", "", '.', ".weight"};
  static constexpr Int4TensorNames kCt{"weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx",
                                       "weight_shape", '.', ".weight"};
  static constexpr Int4TensorNames kMx{"blocks", "", "scales", "", "", '_', ""};
  switch (k) {
    case Int4Scheme::Kind::Awq: return kAwq;
    case Int4Scheme::Kind::Gptq: return kGptq;
    case Int4Scheme::Kind::CompressedTensors: return kCt;
    case Int4Scheme::Kind::Mxfp4: return kMx;
  }
  return kAwq;
}

Int4Module check_int4_module(const Int4Scheme& s, const std::string& base, const TensorInfo* qweight,
                             const TensorInfo* qzeros, const TensorInfo* scales, const TensorInfo* g_idx,
                             const TensorView* shape) {
  Int4Module m{.qweight = qweight, .qzeros = qzeros, .scales = scales, .g_idx = g_idx};
  const Int4TensorNames& n = int4_tensor_names(s.kind);
  const std::string qw = base + n.sep + n.packed;
  if (s.kind == Int4Scheme::Kind::Mxfp4) {  // blocks [E][out][in / 32][16], scales [E][out][in / 32], both uint8
    const auto& b = qweight->shape;
    if (qweight->dtype != DType::U8 || b.size() != 4 || b[3] != 16 || b[0] <= 0 || b[1] <= 0 || b[2] <= 0)
      throw Error("tensor '" + qw + "' has dtype " + std::string(dtype_name(qweight->dtype)) + " and shape " +
                  shape_of(*qweight) + "; MXFP4 experts are uint8 [experts][rows][columns / 32][16]");
    m.experts = b[0];
    m.rows = b[1];
    m.cols = b[2] * 32;
    const std::string sn = base + n.sep + n.scales;
    if (!scales) throw Error("the checkpoint's MXFP4 tensor '" + qw + "' has no '" + sn + "'");
    if (scales->dtype != DType::U8 || scales->shape != std::vector<int64_t>{b[0], b[1], b[2]})
      throw Error("tensor '" + sn + "' has dtype " + std::string(dtype_name(scales->dtype)) + " and shape " +
                  shape_of(*scales) + "; expected uint8 [" + std::to_string(b[0]) + ", " + std::to_string(b[1]) +
                  ", " + std::to_string(b[2]) + "] (one E8M0 exponent per block of '" + qw + "')");
    return m;
  }
  if (qweight->dtype != DType::I32 || qweight->shape.size() != 2)
    throw Error("tensor '" + qw + "' has dtype " + std::string(dtype_name(qweight->dtype)) + " and shape " +
                shape_of(*qweight) + "; " + s.describe() + " packs codes as a 2-D int32 tensor");
  const bool ct = s.kind == Int4Scheme::Kind::CompressedTensors;
  if (ct) {
    const std::string sn = base + "." + n.shape;
    if (!shape) throw Error("the checkpoint has '" + qw + "' but no '" + sn + "'");
    const TensorInfo& si = *shape->info;
    if ((si.dtype != DType::I64 && si.dtype != DType::I32) || si.shape.size() != 1 || si.shape[0] != 2)
      throw Error("tensor '" + sn + "' has dtype " + std::string(dtype_name(si.dtype)) + " and shape " + shape_of(si) +
                  "; expected the weight's [out, in] as 2 integers");
    int64_t v[2];
    for (int i = 0; i < 2; ++i) {
      if (si.dtype == DType::I64) std::memcpy(&v[i], shape->bytes.data() + 8 * i, 8);
      else v[i] = i32_at(*shape, size_t(i));
    }
    if (v[0] <= 0 || v[1] <= 0 || v[0] > (int64_t(1) << 24) || v[1] > (int64_t(1) << 24))
      throw Error("tensor '" + sn + "' holds [" + std::to_string(v[0]) + ", " + std::to_string(v[1]) +
                  "], which is not the shape of a weight");
    m.rows = v[0];
    m.cols = v[1];
    if (qweight->shape[0] != m.rows || qweight->shape[1] != (m.cols + 7) / 8)
      throw Error("tensor '" + qw + "' has shape " + shape_of(*qweight) + "; expected [" + std::to_string(m.rows) +
                  ", " + std::to_string((m.cols + 7) / 8) + "] for the " + std::to_string(m.rows) + " x " +
                  std::to_string(m.cols) + " weight '" + sn + "' gives");
  } else if (s.kind == Int4Scheme::Kind::Awq) {
    m.cols = qweight->shape[0];
    m.rows = qweight->shape[1] * 8;
  } else {
    m.cols = qweight->shape[0] * 8;
    m.rows = qweight->shape[1];
  }
  const int64_t g = s.group ? s.group : m.cols;
  if (m.cols % g != 0)
    throw Error("tensor '" + qw + "': the weight's " + std::to_string(m.cols) + " input columns are not whole groups of " +
                std::to_string(g) + " (" + s.describe() + ")");
  const int64_t groups = m.cols / g;
  const std::string why = "expected for a " + std::to_string(m.rows) + " x " + std::to_string(m.cols) + " weight (" +
                          s.describe() + ")";
  if (ct) {
    if (qzeros || !s.symmetric) expect(qzeros, base + "." + n.zeros, {(m.rows + 7) / 8, groups}, true, why);
    expect(scales, base + "." + n.scales, {m.rows, groups}, false, why);
  } else {
    expect(qzeros, base + "." + n.zeros, {groups, m.rows / 8}, true, why);
    expect(scales, base + "." + n.scales, {groups, m.rows}, false, why);
  }
  if (g_idx) {
    if (!*n.g_idx) throw Error("tensor '" + base + ".g_idx': AWQ checkpoints have no g_idx");
    expect(g_idx, base + "." + n.g_idx, {m.cols}, true, why);
  }
  return m;
}

int64_t mxfp4_expert_rows(const Int4Module& m, int parity) {
  if (parity < 0) return m.rows;
  if (m.rows % 2 != 0)
    throw Error("an MXFP4 expert tensor of " + std::to_string(m.rows) +
                " rows cannot be split into alternating gate and up rows");
  return m.rows / 2;
}

void mxfp4_expert_to_ggml(const Int4Module& m, const TensorView& blocks, const TensorView& scales, int64_t expert,
                          int parity, uint8_t* out) {
  const int64_t rows = mxfp4_expert_rows(m, parity), nb = m.cols / 32;
  KVLM_CHECK(expert >= 0 && expert < m.experts, "mxfp4_expert_to_ggml: no such expert");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t src = parity < 0 ? r : 2 * r + parity;  // the row in the expert's [out][in]
      const size_t blk = size_t((expert * m.rows + src) * nb + b);
      const uint8_t* q = blocks.bytes.data() + blk * 16;  // byte j: values 2 j (low), 2 j + 1 (high)
      uint8_t* o = out + size_t(r * nb + b) * 17;
      o[0] = scales.bytes[blk];
      auto code = [&](int c) { return (q[c / 2] >> (4 * (c % 2))) & 0xF; };
      for (int j = 0; j < 16; ++j) o[1 + j] = uint8_t(code(j) | code(j + 16) << 4);
    }
}

namespace {

// A module's codes (unsigned, [rows][cols]), its zero points (in the codes' units) and scales
// per (group, row), and each input column's group.
struct Unpacked {
  std::vector<uint8_t> q;
  std::vector<int> z;
  std::vector<float> sc;
  std::vector<int64_t> group_of;
};

Unpacked unpack_int4(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight, const TensorView* qzeros,
                     const TensorView& scales, const TensorView* g_idx) {
  const int64_t rows = m.rows, cols = m.cols, g = s.group ? s.group : cols, groups = cols / g;
  Unpacked u;
  u.q.resize(size_t(rows * cols));
  u.z.assign(size_t(groups * rows), 8);  // compressed-tensors symmetric: signed 0
  u.sc.resize(size_t(groups * rows));
  static constexpr int kAwqColumn[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i -> column 8 c + this
  const bool ct = s.kind == Int4Scheme::Kind::CompressedTensors;
  if (ct) {  // zeros [ceil(rows / 8)][groups], packed along the rows; scales [rows][groups]
    if (qzeros)
      for (int64_t r = 0; r < (rows + 7) / 8; ++r)
        for (int64_t gi = 0; gi < groups; ++gi) {
          const int32_t word = i32_at(*qzeros, size_t(r * groups + gi));
          for (int j = 0; j < 8 && 8 * r + j < rows; ++j) u.z[size_t(gi * rows + 8 * r + j)] = nibble(word, j);
        }
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t gi = 0; gi < groups; ++gi) u.sc[size_t(gi * rows + o)] = float_at(scales, size_t(o * groups + gi));
  } else {
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t c = 0; c < rows / 8; ++c) {
        const int32_t word = i32_at(*qzeros, size_t(gi * (rows / 8) + c));
        for (int i = 0; i < 8; ++i) {
          const int64_t o = 8 * c + (s.kind == Int4Scheme::Kind::Awq ? kAwqColumn[i] : i);
          u.z[size_t(gi * rows + o)] = nibble(word, i) + (s.zeros_minus_one ? 1 : 0);
        }
      }
    for (size_t i = 0; i < u.sc.size(); ++i) u.sc[i] = float_at(scales, i);
  }
  u.group_of.resize(size_t(cols));
  for (int64_t i = 0; i < cols; ++i) {
    u.group_of[size_t(i)] = g_idx ? i32_at(*g_idx, size_t(i)) : i / g;
    if (u.group_of[size_t(i)] < 0 || u.group_of[size_t(i)] >= groups)
      throw Error("tensor '" + g_idx->info->name + "': input row " + std::to_string(i) + " names group " +
                  std::to_string(u.group_of[size_t(i)]) + " of " + std::to_string(groups));
  }
  // The codes, in [rows][cols]: each layout's words are walked so that the reads take whole
  // cache lines and every row being written has a line in cache, over threads that write
  // disjoint rows (a Qwen3-8B AWQ checkpoint took 74 s to load, 70% of it here, element by
  // element down the columns).
  uint8_t* q = u.q.data();
  if (ct) {  // qweight [rows][ceil(cols / 8)]: already row-major
    const int64_t words = (cols + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t c = 0; c < words; ++c) {
        const int32_t word = i32_at(qweight, size_t(o * words + c));
        for (int j = 0; j < 8 && 8 * c + j < cols; ++j) q[o * cols + 8 * c + j] = uint8_t(nibble(word, j));
      }
  } else if (s.kind == Int4Scheme::Kind::Awq) {  // qweight [in][out / 8]: a transpose, in tiles
    // of 16 words (a line of a row: 128 outputs) by 64 inputs, turned in a buffer in L1 and
    // written out 64 bytes a row.
    const int64_t words = rows / 8;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t c0 = 0; c0 < words; c0 += 16)
      for (int64_t i0 = 0; i0 < cols; i0 += 64) {
        uint8_t tile[128][64];
        const int64_t nc = std::min<int64_t>(16, words - c0), ni = std::min<int64_t>(64, cols - i0);
        for (int64_t i = 0; i < ni; ++i)
          for (int64_t c = 0; c < nc; ++c) {
            const int32_t word = i32_at(qweight, size_t((i0 + i) * words + c0 + c));
            for (int n = 0; n < 8; ++n) tile[8 * c + kAwqColumn[n]][i] = uint8_t(nibble(word, n));
          }
        for (int64_t o = 0; o < 8 * nc; ++o) std::memcpy(q + (8 * c0 + o) * cols + i0, tile[o], size_t(ni));
      }
  } else {  // qweight [in / 8][out]: 16 output rows (a line of each word row) at a time
#pragma omp parallel for schedule(static)
    for (int64_t o0 = 0; o0 < rows; o0 += 16)
      for (int64_t r = 0; r < cols / 8; ++r)
        for (int64_t o = o0; o < std::min(rows, o0 + 16); ++o) {
          const int32_t word = i32_at(qweight, size_t(r * rows + o));
          for (int j = 0; j < 8; ++j) q[o * cols + 8 * r + j] = uint8_t(nibble(word, j));
        }
  }
  return u;
}

}  // namespace

std::vector<float> dequantize_int4(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                                   const TensorView* qzeros, const TensorView& scales, const TensorView* g_idx) {
  KVLM_CHECK(s.kind != Int4Scheme::Kind::Mxfp4, "dequantize_int4: MXFP4 experts are read one expert at a time");
  const Unpacked u = unpack_int4(s, m, qweight, qzeros, scales, g_idx);
  const int64_t rows = m.rows, cols = m.cols;
  std::vector<float> w(size_t(rows * cols));
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t i = 0; i < cols; ++i) {
      const size_t gz = size_t(u.group_of[size_t(i)] * rows + o);
      w[size_t(o * cols + i)] = float(int(u.q[size_t(o * cols + i)]) - u.z[gz]) * u.sc[gz];
    }
  return w;
}

int int4_grouped_group(const Int4Scheme& s, const Int4Module& m, const TensorView* g_idx) {
  if (s.kind == Int4Scheme::Kind::Mxfp4) return 0;  // E2M1 codes are not affine
  const int64_t g = s.group ? s.group : m.cols;
  if (g % 32 != 0 || g > 0xFFFF || m.cols % g != 0) return 0;
  if (g_idx)  // desc_act / actorder: only the trivial order keeps consecutive groups
    for (int64_t i = 0; i < m.cols; ++i)
      if (i32_at(*g_idx, size_t(i)) != i / g) return 0;
  return int(g);
}

void int4_to_grouped_rows(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                          const TensorView* qzeros, const TensorView& scales, const TensorView* g_idx, int group,
                          uint8_t* out) {
  KVLM_CHECK(group > 0 && m.cols % group == 0 && m.cols % 2 == 0, "int4_to_grouped_rows: a group that does not fit");
  const Unpacked u = unpack_int4(s, m, qweight, qzeros, scales, g_idx);
  const int64_t rows = m.rows, cols = m.cols, groups = cols / group;
  const size_t cb = size_t(cols) / 2, rb = grouped_rows_bytes(group, cols);
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < rows; ++o) {
    uint8_t* row = out + size_t(o) * rb;
    const uint8_t* q = u.q.data() + size_t(o * cols);
    for (int64_t i = 0; i < cols; i += 2) row[i / 2] = uint8_t(q[i] | q[i + 1] << 4);
    for (int64_t gi = 0; gi < groups; ++gi) {  // w = (q - z) s
      const size_t gz = size_t(gi * rows + o);
      const float sc = u.sc[gz], z = float(u.z[gz]);
      std::memcpy(row + cb + size_t(8 * gi), &sc, 4);
      std::memcpy(row + cb + size_t(8 * gi + 4), &z, 4);
    }
  }
}

}  // namespace kvlm
