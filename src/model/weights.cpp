#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "core/numeric.h"
#include "io/gguf_model.h"

namespace kvlm {

std::vector<int64_t> WeightPiece::held_shape() const {
  switch (layout) {
    case PieceLayout::Plain:
      if (row_count <= 0) return shape;
      {
        KVLM_CHECK(!shape.empty() && row_begin >= 0 && row_begin + row_count <= shape[0],
                   "a piece's rows [begin, begin + count) lie inside its tensor");
        std::vector<int64_t> s = shape;
        s[0] = row_count;
        return s;
      }
    case PieceLayout::ExpertsTransposed:
    case PieceLayout::ExpertsTransposedInterleaved:
      KVLM_CHECK(shape.size() == 3, "a fused expert tensor is [experts][in][out]");
      return {shape[0] * shape[2], shape[1]};
    case PieceLayout::ExpertsInterleaved:
      KVLM_CHECK(shape.size() == 2, "a fused expert bias is [experts][out]");
      return {shape[0] * shape[1]};
    case PieceLayout::ExpertsStacked:
      KVLM_CHECK(shape.size() == 3, "a stacked expert tensor is [experts][out][in]");
      return {shape[0] * shape[1], shape[2]};
    case PieceLayout::GroupRows:
      KVLM_CHECK(shape.size() == 2 && shard_units > 0 && shape[0] % shard_units == 0 && group_begin >= 0 &&
                     group_rows > 0 && group_begin + group_rows <= shape[0] / shard_units,
                 "a GroupRows piece takes rows [begin, begin + rows) of each of its [groups][rows per group][in]");
      return {shard_units * group_rows, shape[1]};
  }
  return shape;
}

int64_t WeightSpec::rows() const {
  if (pieces.empty()) return int64_t(constant.size());
  int64_t r = 0;
  for (const auto& p : pieces) {
    const auto s = p.held_shape();
    r += s.empty() ? 1 : s[0];
  }
  return r;
}

int64_t WeightSpec::cols() const {
  if (pieces.empty()) return 1;
  const auto s = pieces[0].held_shape();
  int64_t c = 1;
  for (size_t i = 1; i < s.size(); ++i) c *= s[i];
  return c;
}

DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt) {
  if (cfg.declared_dtype) return *cfg.declared_dtype;
  if (auto d = ckpt.dtype_of("model.embed_tokens.weight"); d && (*d == DType::F32 || *d == DType::F16 || *d == DType::BF16))
    return *d;
  return DType::BF16;
}

std::vector<float> fp8_quantize_rows(std::span<const float> w, int64_t rows, int64_t cols, std::span<uint8_t> codes) {
  KVLM_CHECK(w.size() == size_t(rows * cols) && codes.size() == w.size(), "fp8_quantize_rows: size mismatch");
  std::vector<float> scales(static_cast<size_t>(rows));
  // Rows are independent (an 8B model's projections are ~7e9 values: seconds, not minutes).
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w.data() + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    scales[size_t(r)] = scale;
    for (int64_t c = 0; c < cols; ++c) codes[size_t(r * cols + c)] = num::f32_to_e4m3(row[c] / scale);
  }
  return scales;
}

std::vector<float> fp8_round_trip_rows(std::span<float> w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales = fp8_quantize_rows(w, rows, cols, codes);
  const int64_t n = int64_t(w.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) w[size_t(i)] = num::e4m3_to_f32(codes[size_t(i)]) * scales[size_t(i / cols)];
  return scales;
}

void piece_to_f32(const TensorView& v, const PieceQuant& q, std::span<float> out) {
  const TensorInfo& t = *v.info;
  KVLM_CHECK(out.size() == size_t(t.numel()), "piece_to_f32: size mismatch");
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0], cols = rows ? t.numel() / rows : 0;
  if (!q.fp8()) {
    convert_to_f32(t.dtype, v.bytes, out);
    if (q.quantize) fp8_round_trip_rows(out, rows, cols);
    return;
  }
  KVLM_CHECK(t.dtype == DType::F8E4M3, "FP8 scales on a tensor that is not float8_e4m3fn");
  const std::vector<float> rs = fp8_row_scales(q, rows, cols);
  const int64_t block = q.scaling == Fp8Scaling::Block ? q.block_cols : cols, nb = rs.size() / size_t(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* codes = v.bytes.data() + r * cols;
    const float* s = rs.data() + r * nb;
    float* o = out.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = num::e4m3_to_f32(codes[c]) * s[c / block];
  }
}

std::vector<float> fp8_row_scales(const PieceQuant& q, int64_t rows, int64_t cols) {
  std::vector<float> sc(size_t(q.scale.info->numel()));
  convert_to_f32(q.scale.info->dtype, q.scale.bytes, sc);
  const bool block = q.scaling == Fp8Scaling::Block;
  const int64_t nb = block ? (cols + q.block_cols - 1) / q.block_cols : 1;
  std::vector<float> out(size_t(rows * nb));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b)
      out[size_t(r * nb + b)] = q.scaling == Fp8Scaling::Tensor    ? sc[0]
                                : q.scaling == Fp8Scaling::Channel ? sc[size_t(r)]
                                                                   : sc[size_t((r / q.block_rows) * nb + b)];
  return out;
}

namespace {

// The scale tensor of FP8 piece `t` under `q`, its dtype and shape checked.
PieceQuant fp8_piece(const Checkpoint& ckpt, const TensorInfo& t, const WeightSpec& s, const std::optional<WeightQuantConfig>& q,
                     std::set<std::string>& used) {
  const std::string name = ckpt.describe(t.name);
  if (!q)
    throw Error("tensor " + name + " is float8_e4m3fn, but config.json declares no FP8 quantization_config to say how "
                "it is scaled; kvlm runs compressed-tensors, modelopt and fp8 (block-wise) FP8 checkpoints");
  if (q->on_the_fly)
    throw Error("tensor " + name + " is already float8_e4m3fn; --quantization fp8 quantizes 16-bit checkpoints, and an "
                "FP8 checkpoint runs without it (its quantization_config says how)");
  if (s.role != WeightRole::Matrix || t.shape.size() != 2)
    throw Error("tensor " + name + " is float8_e4m3fn; kvlm runs FP8 weight matrices only (biases, norms and "
                "embeddings stay 16/32-bit)");
  if (!t.name.ends_with(".weight"))
    throw Error("tensor " + name + " is float8_e4m3fn but its name does not end in '.weight'; the scale tensor "
                "cannot be found");
  const std::string scale_name = t.name.substr(0, t.name.size() - 6) + q->scale_name;
  const TensorInfo* st = ckpt.find(scale_name);
  if (!st)
    throw Error("tensor " + name + " is float8_e4m3fn but the checkpoint has no '" + scale_name + "' (" + q->origin +
                " keeps a " + std::string(fp8_scaling_name(q->scaling)) + " scale there); the checkpoint is incomplete");
  if (st->dtype != DType::F32 && st->dtype != DType::BF16 && st->dtype != DType::F16)
    throw Error("scale tensor '" + scale_name + "' has dtype " + std::string(dtype_name(st->dtype)) +
                "; expected float32, bfloat16 or float16");
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<std::vector<int64_t>> ok;
  std::string expect;
  switch (q->scaling) {
    case Fp8Scaling::Tensor:
      ok = {{}, {1}};
      expect = "[] or [1] (one per-tensor scale)";
      break;
    case Fp8Scaling::Channel:
      ok = {{rows, 1}, {rows}};
      expect = shape_str(ok[0]) + " (one scale per output channel)";
      break;
    case Fp8Scaling::Block: {
      const int64_t br = (rows + q->block_rows - 1) / q->block_rows, bc = (cols + q->block_cols - 1) / q->block_cols;
      ok = {{br, bc}};
      expect = shape_str(ok[0]) + " (one scale per " + std::to_string(q->block_rows) + "x" +
               std::to_string(q->block_cols) + " block of the " + shape_str(t.shape) + " weight)";
      break;
    }
  }
  if (std::ranges::find(ok, st->shape) == ok.end())
    throw Error("scale tensor '" + scale_name + "' has shape " + shape_str(st->shape) + "; the " + q->origin + " " +
                std::string(fp8_scaling_name(q->scaling)) + " scheme of config.json needs " + expect);
  used.insert(scale_name);
  PieceQuant p{.scale = ckpt.view(scale_name), .scaling = q->scaling, .block_rows = q->block_rows,
               .block_cols = q->block_cols};
  std::vector<float> sc(size_t(st->numel()));
  convert_to_f32(st->dtype, p.scale.bytes, sc);
  for (size_t i = 0; i < sc.size(); ++i)
    if (!std::isfinite(sc[i]) || sc[i] < 0.0f)
      throw Error("scale tensor '" + scale_name + "' holds " + std::to_string(sc[i]) + " at index " + std::to_string(i) +
                  "; FP8 weight scales must be finite and non-negative (a corrupt checkpoint?)");
  return p;
}


// The scale block of a slice starting at `begin` of a dimension scaled in blocks of `block`:
// the largest width that divides both, so that each of the slice's blocks lies inside one of
// the checkpoint's.
int64_t local_scale_block(int64_t begin, int64_t block) { return begin == 0 ? block : std::gcd(begin, block); }

// One checkpoint piece as a tensor-parallel rank holds it: its slice (a view into the
// checkpoint when the slice is whole rows, else a copy) and its FP8 scales sliced alike.
struct LocalPiece {
  TensorInfo info, scale_info;
  std::vector<uint8_t> bytes, scale_bytes;
  TensorView view;
  PieceQuant quant;
};

// Elements [begin, begin + count) along `dim` (0: rows; 1: columns, the product of the
// remaining dims) of `v`, into `info` (its shape reduced) and `out` (a subspan of v's bytes
// for rows, a copy in `owned` for columns).
void slice_tensor(const TensorView& v, int dim, int64_t begin, int64_t count, TensorInfo& info,
                  std::vector<uint8_t>& owned, std::span<const uint8_t>& out, int64_t groups = 1) {
  const TensorInfo& t = *v.info;
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0], cols = rows ? t.numel() / rows : 0;
  const size_t es = dtype_size(t.dtype);
  info = t;
  if (dim == 0 && groups > 1) {  // rows [begin, begin + count) of every group of rows / groups
    const int64_t per = rows / groups;
    info.shape[0] = groups * count;
    owned.resize(size_t(groups * count * cols) * es);
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(owned.data() + size_t(g * count * cols) * es, v.bytes.data() + size_t((g * per + begin) * cols) * es,
                  size_t(count * cols) * es);
    out = owned;
    return;
  }
  if (dim == 0) {
    info.shape[0] = count;
    out = v.bytes.subspan(size_t(begin * cols) * es, size_t(count * cols) * es);
    return;
  }
  KVLM_CHECK(t.shape.size() == 2, "a column slice of a tensor that is not a matrix");
  info.shape[1] = count;
  owned.resize(size_t(rows * count) * es);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(owned.data() + size_t(r * count) * es, v.bytes.data() + size_t(r * cols + begin) * es, size_t(count) * es);
  out = owned;
}

// The part of piece `p` of spec `s` (Shard::Rows or Cols) that rank tp holds: rows (dim 0) or
// columns (dim 1) [begin, begin + count), in whole units of p.shard_units. Throws naming
// `name` when the piece does not split over tp.world ranks.
struct PieceSlice {
  int dim = 0;
  int64_t begin = 0, count = 0;  // within each group of rows
  int64_t groups = 1;
};
PieceSlice piece_slice(const WeightPiece& p, const WeightSpec& s, TpRank tp, const std::string& name) {
  const bool split = split_over_ranks(s.shard, tp.world);
  if (p.row_count > 0) {  // a section of its tensor's rows: the rank's share of it
    KVLM_CHECK(p.layout == PieceLayout::Plain && p.row_groups <= 1 && (!split || s.shard == Shard::Rows),
               "a section of a tensor's rows splits by rows only");
    if (!split) return {0, p.row_begin, p.row_count, 1};
    const int64_t units = p.shard_units > 0 ? p.shard_units : p.row_count;
    if (p.row_count % units != 0 || (units % tp.world != 0 && tp.world % units != 0))
      throw Error("tensor " + name + ": its rows [" + std::to_string(p.row_begin) + ", " +
                  std::to_string(p.row_begin + p.row_count) + ") cannot be split over --tensor-parallel-size " +
                  std::to_string(tp.world));
    const UnitRange u = shard_units(units, tp);
    const int64_t unit = p.row_count / units;
    return {0, p.row_begin + u.begin * unit, u.count * unit, 1};
  }
  if (s.shard == Shard::Experts) {  // whole experts: the rank's run of them
    KVLM_CHECK(p.shard_units > 0, "an expert-parallel piece without its expert count");
    const UnitRange u = shard_units(p.shard_units, tp);
    if (p.expert >= 0) {
      const bool mine = p.expert >= u.begin && p.expert < u.begin + u.count;
      return {0, 0, mine ? p.shape[0] : 0, 1};
    }
    if (p.shape[0] % p.shard_units != 0)
      throw Error("tensor " + name + ": its rows do not form " + std::to_string(p.shard_units) + " equal experts");
    const int64_t unit = p.shape[0] / p.shard_units;
    return {0, u.begin * unit, u.count * unit, 1};
  }
  const int dim = s.shard == Shard::Rows ? 0 : 1;
  const int64_t groups = dim == 0 && p.row_groups > 1 ? p.row_groups : 1;
  if (p.shape[size_t(dim)] % groups != 0)
    throw Error("tensor " + name + ": its rows do not form " + std::to_string(groups) + " equal groups");
  const int64_t size = p.shape[size_t(dim)] / groups;
  const int64_t units = p.shard_units > 0 ? p.shard_units : size;
  if (size % units != 0 || (units % tp.world != 0 && tp.world % units != 0))
    throw Error("tensor " + name + ": its " + (dim == 0 ? "rows" : "columns") + " (" + std::to_string(size) +
                ") cannot be split over --tensor-parallel-size " + std::to_string(tp.world));
  const UnitRange u = shard_units(units, tp);
  const int64_t unit = size / units;
  return {dim, u.begin * unit, u.count * unit, groups};
}

// Rank tp's slice of piece `v` (quantized as `q`) of spec `s` (piece_slice), scales included.
void slice_piece(const Checkpoint& ckpt, const WeightPiece& p, const WeightSpec& s, const TensorView& v,
                 const PieceQuant& q, TpRank tp, LocalPiece& out) {
  const auto [dim, begin, count, groups] = piece_slice(p, s, tp, ckpt.describe(p.name));
  KVLM_CHECK(groups == 1 || !q.fp8(), "FP8 scales of a grouped piece");
  std::span<const uint8_t> bytes;
  slice_tensor(v, dim, begin, count, out.info, out.bytes, bytes, groups);
  out.view = TensorView{&out.info, bytes};
  out.quant = q;
  if (!q.fp8()) return;
  if (q.scaling == Fp8Scaling::Channel && dim == 0) {  // one scale per row: the rank's rows
    std::span<const uint8_t> sbytes;
    slice_tensor(q.scale, 0, begin, count, out.scale_info, out.scale_bytes, sbytes);
    out.quant.scale = TensorView{&out.scale_info, sbytes};
  } else if (q.scaling == Fp8Scaling::Block) {
    // The slice may start inside a scale block (a small model's heads): its blocks become
    // g = gcd(begin, block) wide, each inside one of the checkpoint's, with that block's scale.
    const int64_t b = dim == 0 ? q.block_rows : q.block_cols, g = local_scale_block(begin, b);
    const int64_t nl = (count + g - 1) / g;
    const TensorInfo& st = *q.scale.info;
    const int64_t srows = st.shape[0], scols = st.shape[1];
    const size_t es = dtype_size(st.dtype);
    out.scale_info = st;
    out.scale_info.shape[size_t(dim)] = nl;
    const int64_t orows = dim == 0 ? nl : srows, ocols = dim == 0 ? scols : nl;
    out.scale_bytes.resize(size_t(orows * ocols) * es);
    for (int64_t r = 0; r < orows; ++r)
      for (int64_t c = 0; c < ocols; ++c) {
        const int64_t gr = dim == 0 ? (begin + r * g) / b : r, gc = dim == 1 ? (begin + c * g) / b : c;
        std::memcpy(out.scale_bytes.data() + size_t(r * ocols + c) * es, q.scale.bytes.data() + size_t(gr * scols + gc) * es, es);
      }
    out.quant.scale = TensorView{&out.scale_info, out.scale_bytes};
    (dim == 0 ? out.quant.block_rows : out.quant.block_cols) = int(g);
  }
}

// `v` (laid out as `layout`) rearranged as the device holds it (WeightPiece::held_shape) into
// `out`: its info (shape `held`) and bytes.
void relayout_piece(const TensorView& v, const WeightPiece& p, LocalPiece& out) {
  const PieceLayout layout = p.layout;
  const std::vector<int64_t> held = p.held_shape();
  const TensorInfo& t = *v.info;
  const size_t es = dtype_size(t.dtype);
  out.info = t;
  out.info.shape = held;
  if (layout == PieceLayout::ExpertsStacked) {  // a reshape: the view keeps the checkpoint's bytes
    out.bytes.clear();
    out.view = TensorView{&out.info, v.bytes};
    return;
  }
  out.bytes.resize(size_t(std::accumulate(held.begin(), held.end(), int64_t(1), std::multiplies<>())) * es);
  const uint8_t* src = v.bytes.data();
  uint8_t* dst = out.bytes.data();
  // Row r of an expert's gate/up output: column r of the gate (even columns) or of up (odd).
  auto interleaved_col = [](int64_t r, int64_t half) { return r < half ? 2 * r : 2 * (r - half) + 1; };
  if (layout == PieceLayout::GroupRows) {  // rows [per g + begin, + rows) of every group g
    const int64_t in = t.shape[1], groups = p.shard_units, per = t.shape[0] / groups, n = p.group_rows;
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(dst + size_t(g * n * in) * es, src + size_t((per * g + p.group_begin) * in) * es, size_t(n * in) * es);
    out.view = TensorView{&out.info, out.bytes};
    return;
  }
  if (layout == PieceLayout::ExpertsInterleaved) {
    const int64_t E = t.shape[0], n = t.shape[1];
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(dst + size_t(e * n + r) * es, src + size_t(e * n + interleaved_col(r, n / 2)) * es, es);
  } else {
    const int64_t E = t.shape[0], in = t.shape[1], n = t.shape[2];
    const bool interleaved = layout == PieceLayout::ExpertsTransposedInterleaved;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < n; ++r) {
        const int64_t c = interleaved ? interleaved_col(r, n / 2) : r;
        uint8_t* d = dst + size_t((e * n + r) * in) * es;
        const uint8_t* s = src + size_t(e * in * n + c) * es;
        for (int64_t i = 0; i < in; ++i) std::memcpy(d + size_t(i) * es, s + size_t(i * n) * es, es);
      }
  }
  out.view = TensorView{&out.info, out.bytes};
}

// The spec rank tp holds: pieces with the rank's shapes (RankZero on another rank: no rows).
WeightSpec local_spec(const WeightSpec& s, TpRank tp) {
  WeightSpec l = s;
  if (!sliced_by_tp(s, tp.world) && !(s.shard == Shard::RankZero && tp.world > 1)) return l;
  for (WeightPiece& p : l.pieces) {
    if (p.row_count > 0) {  // a section of its tensor: the rank's rows of it
      p.shape[0] = piece_slice(p, s, tp, "'" + p.name + "'").count;
      p.row_begin = p.row_count = 0;
      continue;
    }
    p.shape = p.held_shape();  // what the sink receives: rearranged, then sliced
    p.layout = PieceLayout::Plain;
    if (s.shard == Shard::Rows || s.shard == Shard::Cols || s.shard == Shard::Experts) {
      const PieceSlice sl = piece_slice(p, s, tp, "'" + p.name + "'");
      p.shape[size_t(sl.dim)] = sl.count * sl.groups;
    } else if (s.shard == Shard::RankZero && tp.rank != 0) {
      p.shape[0] = 0;
    }
  }
  return l;
}

}  // namespace

Weight WeightSink::store_blocks(const WeightSpec& spec, std::span<const Checkpoint::Blocks> pieces) {
  (void)pieces;
  throw Error("this device does not keep GGUF blocks (weight '" + spec.pieces.at(0).name + "')");
}

void copy_block_rows(const Checkpoint::Blocks& p, uint8_t* out) {
  if (p.fill) {
    KVLM_CHECK(p.unpermute_heads <= 0, "copy_block_rows: formed rows are in Hugging Face's order already");
    p.fill(out);
    return;
  }
  if (p.unpermute_heads <= 0) {
    std::memcpy(out, p.bytes.data(), size_t(p.rows) * p.row_bytes);
    return;
  }
  const int heads = p.unpermute_heads;
  if (p.rows % heads != 0 || (p.rows / heads) % 2 != 0)
    throw Error("a GGUF q/k matrix of " + std::to_string(p.rows) + " rows is not " + std::to_string(heads) +
                " heads of an even size");
  for (int64_t r = 0; r < p.rows; ++r)
    std::memcpy(out + size_t(r) * p.row_bytes,
                p.bytes.data() + size_t(llama_head_source_row(r, p.unpermute_heads, p.rows)) * p.row_bytes, p.row_bytes);
}

LoadedWeights load_weights(const WeightList& list, const Checkpoint& ckpt, WeightSink& sink,
                           const std::optional<WeightQuantConfig>& quant, TpRank tp) {
  std::set<std::string> used(list.known_unused.begin(), list.known_unused.end());
  size_t tensor_bytes = 0;
  for (const WeightSpec& s : list.specs) {
    for (const WeightPiece& p : s.pieces) {
      const TensorInfo* t = ckpt.find(p.name);
      if (!t) throw Error("the checkpoint is missing tensor '" + p.name + "'" + s.missing_hint);
      tensor_bytes += t->end - t->begin;
    }
  }
  // What this rank holds: every spec with the rank's shapes, less RankZero weights elsewhere.
  std::vector<WeightSpec> held;
  std::vector<bool> skip(list.specs.size(), false);
  for (size_t i = 0; i < list.specs.size(); ++i) {
    skip[i] = tp.world > 1 && tp.rank != 0 && list.specs[i].shard == Shard::RankZero;
    if (!skip[i]) held.push_back(local_spec(list.specs[i], tp));
  }
  // Which weights are FP8 as a whole (all pieces FP8 codes with scales, or quantized at load).
  std::vector<SpecQuant> sq(held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    const WeightSpec& s = held[i];
    if (!quant || !s.linear || s.pieces.empty()) continue;
    bool all_fp8 = true, all_dense = true;
    for (const WeightPiece& p : s.pieces) {
      const DType d = ckpt.find(p.name)->dtype;
      all_fp8 &= d == DType::F8E4M3;
      all_dense &= d == DType::F32 || d == DType::F16 || d == DType::BF16;
    }
    if (quant->on_the_fly ? all_dense : all_fp8) {
      int block = int(s.cols());
      if (!quant->on_the_fly && quant->scaling == Fp8Scaling::Block) {
        block = quant->block_cols;
        if (tp.world > 1 && s.shard == Shard::Cols)  // the rank's columns: slice_piece's blocks
          block = int(local_scale_block(s.pieces[0].shape[1] * tp.rank, block));
      }
      sq[i] = SpecQuant{.fp8 = true, .scale_block = block};
    }
  }
  auto sliced = [&](const WeightSpec& s) { return sliced_by_tp(s, tp.world); };
  // Which matrices come as GGUF blocks the device keeps: every piece of a kept block type, and
  // not sliced (tensor-parallel slices and expert layouts take the dequantized path).
  {
    size_t h = 0;
    for (size_t si = 0; si < list.specs.size(); ++si) {
      if (skip[si]) continue;
      const WeightSpec& s = list.specs[si];
      const size_t i = h++;
      if (s.role != WeightRole::Matrix || sliced(s) || s.pieces.empty()) continue;
      std::vector<uint32_t> types;
      for (const WeightPiece& p : s.pieces) {
        auto b = p.layout == PieceLayout::Plain ? ckpt.blocks(p.name) : std::nullopt;
        if (!b || !sink.keeps_blocks(b->type)) break;
        types.push_back(b->type);
      }
      if (types.size() == s.pieces.size()) sq[i].block_types = std::move(types);
    }
  }
  sink.reserve(held, sq);
  // Large checkpoints show a progress line while loading (small ones would only flicker).
  log::Progress progress("loading weights", tensor_bytes >= (size_t(256) << 20) ? tensor_bytes : 0);
  LoadedWeights out;
  size_t done = 0;
  std::vector<TensorView> views;
  std::vector<PieceQuant> pq;
  std::vector<float> values, conv;
  const bool on_the_fly = quant && quant->on_the_fly;
  std::deque<LocalPiece> local;  // this spec's slices (stable addresses: the views point into them)
  auto check_shape = [&](const TensorInfo& t, const WeightPiece& p) {
    if (!std::ranges::equal(t.shape, p.shape))
      throw Error("tensor " + ckpt.describe(t.name) + " has shape " + shape_str(t.shape) + " but " +
                  (ckpt.embedded_config() ? "the GGUF metadata implies " : "config.json implies ") + shape_str(p.shape));
  };
  size_t next_held = 0;
  for (size_t si = 0; si < list.specs.size(); ++si) {
    const WeightSpec& s = list.specs[si];
    if (skip[si]) {
      out.weights.push_back(Weight{});
      for (const WeightPiece& p : s.pieces) {
        used.insert(p.name);
        progress.update(done += ckpt.find(p.name)->end - ckpt.find(p.name)->begin);
      }
      continue;
    }
    const size_t hi = next_held++;
    const WeightSpec& ls = held[hi];
    // A matrix stored in GGUF blocks the device keeps: handed over as the blocks, never dequantized.
    if (!sq[hi].block_types.empty()) {
      std::vector<Checkpoint::Blocks> bp;
      for (const WeightPiece& p : s.pieces) {
        check_shape(*ckpt.find(p.name), p);
        bp.push_back(*ckpt.blocks(p.name));
        used.insert(p.name);
        done += ckpt.find(p.name)->end - ckpt.find(p.name)->begin;
      }
      for (const auto& b : bp) out.num_params += size_t(b.rows * b.cols);
      out.block_tensors += bp.size();
      out.weights.push_back(sink.store_blocks(ls, bp));
      progress.update(done);
      continue;
    }
    views.clear();
    pq.clear();
    local.clear();
    for (const WeightPiece& p : s.pieces) {
      const TensorInfo& t = *ckpt.find(p.name);
      check_shape(t, p);  // before the view: a GGUF view dequantizes
      if (t.dtype == DType::F8E4M3) {
        pq.push_back(fp8_piece(ckpt, t, s, quant, used));
      } else if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16) {
        throw Error("tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                    "; kvlm loads bfloat16, float16 and float32 weights, and float8_e4m3fn ones with their scales "
                    "(FP8 checkpoints)");
      } else {
        pq.push_back(PieceQuant{.quantize = on_the_fly && s.linear});
      }
      used.insert(p.name);
      done += t.end - t.begin;
      TensorView v = ckpt.view(p.name);
      WeightPiece held = p;  // the piece as the device holds it
      if (p.layout != PieceLayout::Plain) {
        if (t.dtype == DType::F8E4M3)
          throw Error("tensor " + ckpt.describe(t.name) + ": FP8 codes in a tensor kvlm rearranges at load (fused experts, gated q_proj, Qwen3-Next's in_proj) are not "
                      "supported yet");
        relayout_piece(v, p, local.emplace_back());
        v = local.back().view;
        held.shape = p.held_shape();
        held.layout = PieceLayout::Plain;
      }
      if (sliced(s)) {
        slice_piece(ckpt, held, s, v, pq.back(), tp, local.emplace_back());
        views.push_back(local.back().view);
        pq.back() = local.back().quant;
      } else {
        views.push_back(v);
      }
      out.num_params += size_t(views.back().info->numel());
    }
    values.clear();
    if (s.role == WeightRole::Constant) {
      values = s.constant;
    } else if (s.role == WeightRole::Norm) {
      for (const TensorView& v : views) {
        conv.resize(size_t(v.info->numel()));
        convert_to_f32(v.info->dtype, v.bytes, conv);
        values.insert(values.end(), conv.begin(), conv.end());
      }
      if (s.add_one)
        for (float& x : values) x += 1.0f;
    }
    out.weights.push_back(sink.store(ls, views, pq, values));
    progress.update(done);
    for (const WeightPiece& p : s.pieces) ckpt.release(p.name);  // a GGUF tensor's dequantized copy
  }
  std::vector<std::string> extra;
  size_t vision = 0;  // a multimodal checkpoint's vision tower and projector: skipped, said once
  for (const auto& n : ckpt.names()) {
    if (used.count(n) || n.ends_with("_scale") || n.ends_with("rotary_emb.inv_freq")) continue;
    const bool is_vision = n.starts_with("model.visual.") || n.starts_with("visual.") || n.starts_with("vision_tower.") ||
                           n.starts_with("model.vision_tower.") || n.starts_with("multi_modal_projector.") ||
                           n.starts_with("model.multi_modal_projector.");
    if (is_vision) ++vision;
    else extra.push_back(n);
  }
  if (vision > 0)
    log::info("skipping the vision tower (" + std::to_string(vision) +
              " tensors): kvlm runs the language model, and requests with images are refused");
  if (quant && quant->on_the_fly)
    log::info("--quantization fp8: linear weights quantized to FP8 E4M3 at load, one scale per output channel");
  if (!extra.empty())
    log::warn("ignoring " + std::to_string(extra.size()) + " checkpoint tensor(s) this architecture does not use, e.g. '" +
              extra.front() + "'");
  return out;
}

}  // namespace kvlm
