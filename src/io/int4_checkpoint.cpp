#include "io/int4_checkpoint.h"

#include <cstring>

#include "core/error.h"
#include "core/numeric.h"

namespace kvlm {

namespace {

std::string shape_of(const TensorInfo& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void expect(const TensorInfo* t, const std::string& name, std::initializer_list<int64_t> shape, bool int32,
            const std::string& why) {
  if (!t) throw Error("the checkpoint has '" + name.substr(0, name.rfind('.')) + ".qweight' but no '" + name + "'");
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

Int4Module check_int4_module(const Int4Scheme& s, const std::string& base, const TensorInfo* qweight,
                             const TensorInfo* qzeros, const TensorInfo* scales, const TensorInfo* g_idx) {
  Int4Module m{.qweight = qweight, .qzeros = qzeros, .scales = scales, .g_idx = g_idx};
  const std::string qw = base + ".qweight";
  if (qweight->dtype != DType::I32 || qweight->shape.size() != 2)
    throw Error("tensor '" + qw + "' has dtype " + std::string(dtype_name(qweight->dtype)) + " and shape " +
                shape_of(*qweight) + "; " + s.describe() + " packs codes as a 2-D int32 tensor");
  if (s.kind == Int4Scheme::Kind::Awq) {
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
  expect(qzeros, base + ".qzeros", {groups, m.rows / 8}, true, why);
  expect(scales, base + ".scales", {groups, m.rows}, false, why);
  if (g_idx) {
    if (s.kind == Int4Scheme::Kind::Awq) throw Error("tensor '" + base + ".g_idx': AWQ checkpoints have no g_idx");
    expect(g_idx, base + ".g_idx", {m.cols}, true, why);
  }
  return m;
}

std::vector<float> dequantize_int4(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                                   const TensorView& qzeros, const TensorView& scales, const TensorView* g_idx) {
  const int64_t rows = m.rows, cols = m.cols, g = s.group ? s.group : cols, groups = cols / g;
  std::vector<float> w(size_t(rows * cols));
  // z and s of (group, output row), unpacked once.
  std::vector<int> z(size_t(groups * rows));
  std::vector<float> sc(size_t(groups * rows));
  static constexpr int kAwqColumn[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i -> column 8 c + this
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int64_t c = 0; c < rows / 8; ++c) {
      const int32_t word = i32_at(qzeros, size_t(gi * (rows / 8) + c));
      for (int i = 0; i < 8; ++i) {
        const int64_t o = 8 * c + (s.kind == Int4Scheme::Kind::Awq ? kAwqColumn[i] : i);
        z[size_t(gi * rows + o)] = nibble(word, i) + (s.zeros_minus_one ? 1 : 0);
      }
    }
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = float_at(scales, i);
  std::vector<int64_t> group_of(static_cast<size_t>(cols));
  for (int64_t i = 0; i < cols; ++i) {
    group_of[size_t(i)] = g_idx ? i32_at(*g_idx, size_t(i)) : i / g;
    if (group_of[size_t(i)] < 0 || group_of[size_t(i)] >= groups)
      throw Error("tensor '" + g_idx->info->name + "': input row " + std::to_string(i) + " names group " +
                  std::to_string(group_of[size_t(i)]) + " of " + std::to_string(groups));
  }
  auto put = [&](int64_t o, int64_t i, int q) {
    const size_t gz = size_t(group_of[size_t(i)] * rows + o);
    w[size_t(o * cols + i)] = float(q - z[gz]) * sc[gz];
  };
  if (s.kind == Int4Scheme::Kind::Awq) {  // qweight [in][out / 8]
    for (int64_t i = 0; i < cols; ++i)
      for (int64_t c = 0; c < rows / 8; ++c) {
        const int32_t word = i32_at(qweight, size_t(i * (rows / 8) + c));
        for (int n = 0; n < 8; ++n) put(8 * c + kAwqColumn[n], i, nibble(word, n));
      }
  } else {  // qweight [in / 8][out]
    for (int64_t r = 0; r < cols / 8; ++r)
      for (int64_t o = 0; o < rows; ++o) {
        const int32_t word = i32_at(qweight, size_t(r * rows + o));
        for (int j = 0; j < 8; ++j) put(o, 8 * r + j, nibble(word, j));
      }
  }
  return w;
}

}  // namespace kvlm
