// What a model definition loads, stated once per architecture, and the one loader every
// device uses.
//
// A WeightSpec names the checkpoint tensors of one device weight (several, concatenated
// along dim 0, for the fused q/k/v and gate/up projections), their shapes as config.json
// implies them, what kind of weight it is (which decides its element type on each device),
// and how tensor parallelism would split it. load_weights checks every tensor's dtype and
// shape, reports progress and unused tensors, and hands each weight to the device's
// WeightSink, which stores it where the device computes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/weight_quant.h"
#include "io/checkpoint.h"
#include "model/ops.h"
#include "model/tensor_parallel.h"

namespace kvlm {

// The element type a weight gets on a device follows its role: the CPU holds everything in
// fp32; CUDA holds matrices, biases and embedding tables in the compute dtype (bf16/fp16)
// and norms and constants in fp32.
enum class WeightRole : uint8_t {
  Matrix,    // a projection [out][in]; also the embedding table and the LM head
  Bias,      // [out]
  Norm,      // an RMSNorm weight [dim]
  Constant,  // computed on the host from the config (RoPE inverse frequencies)
};

// The element type of a weight of `role` on a GPU whose compute dtype is `compute`.
inline DType gpu_weight_dtype(WeightRole role, DType compute) {
  return role == WeightRole::Matrix || role == WeightRole::Bias ? compute : DType::F32;
}

// How tensor parallelism (model/tensor_parallel.h) splits a weight over ranks.
enum class Shard : uint8_t {
  Replicated,  // every rank holds all of it (norms, constants)
  Rows,        // split along dim 0, the output features: column-parallel (q/k/v, gate/up, their biases)
  Cols,        // split along dim 1, the input features: row-parallel (o, down), followed by an all-reduce
  Vocab,       // the embedding table: replicated (a lookup reads one row per token)
  RankZero,    // rank 0 alone: a row-parallel projection's bias (added once, before the sum) and an
               // untied LM head (only rank 0 forms logits)
  Experts,     // whole experts per rank (expert parallelism): a piece of one expert (WeightPiece::expert)
               // is held whole by the rank owning that expert and not at all by the others; a fused
               // piece splits along dim 0 into shard_units experts, the rank taking its run of them
};

// How a checkpoint lays out a piece when not as the device holds it ([rows][cols], rows
// concatenated): the fused expert tensors of GPT-OSS's checkpoints, [E][in][out] (x . W, not
// PyTorch Linear's [out][in]) with gate and up interleaved column by column. The loader
// rearranges them into the MoeWeights layout (ops.h): [E * out][in], gate rows before up rows.
enum class PieceLayout : uint8_t {
  Plain,
  ExpertsTransposed,             // [E][in][out] -> [E * out][in]
  ExpertsTransposedInterleaved,  // [E][in][2I] with gate, up alternating -> [E * 2I][in], per expert I gate rows then I up
  ExpertsInterleaved,            // a bias [E][2I], gate and up alternating -> [E * 2I], per expert I gate then I up
  ExpertsStacked,                // [E][out][in] (transformers 5's fused Qwen experts) -> [E * out][in]: the same bytes
  // A projection whose rows are shard_units equal groups, of which the piece takes rows
  // [group_begin, group_begin + group_rows) of every group -> [groups * group_rows][in]: the
  // gated q_proj of Qwen3.5 / Qwen3-Next (per head its query, then its gate), Qwen3-Next's
  // in_proj_qkvz / in_proj_ba (per key head q, k, its value heads' v, then z; b, then a).
  GroupRows,
};

struct WeightPiece {
  std::string name;             // checkpoint tensor name
  std::vector<int64_t> shape;   // as config.json implies it, in the checkpoint's layout
  // Rows / Cols: the split dimension is this many equal units (heads: a rank takes whole
  // heads, and a KV head is replicated when there are fewer than ranks); 0 = every row or
  // column is a unit.
  int64_t shard_units = 0;
  PieceLayout layout = PieceLayout::Plain;
  // Rows: the held rows are this many equal groups (a fused expert tensor: each expert's gate
  // and up), and a rank takes its share of every group. 0 or 1: one group.
  int64_t row_groups = 0;
  // Experts: the expert this piece belongs to (-1: a fused piece of every expert).
  int expert = -1;
  // GroupRows: the rows taken from each of the shard_units groups.
  int64_t group_begin = 0, group_rows = 0;
  // Plain: the piece is rows [row_begin, row_begin + row_count) of its tensor (0: every row),
  // split over the ranks in units of shard_units like a whole tensor: one section of a fused
  // projection (Qwen3.5's in_proj_qkv: q, k, then v), cut from the checkpoint's bytes as a
  // tensor-parallel slice is (FP8 scales included).
  int64_t row_begin = 0, row_count = 0;
  // The shape the device holds: `shape` rearranged by `layout`.
  std::vector<int64_t> held_shape() const;
};

struct WeightSpec {
  std::vector<WeightPiece> pieces;  // concatenated along dim 0; empty for a Constant
  WeightRole role = WeightRole::Matrix;
  Shard shard = Shard::Replicated;
  bool add_one = false;             // stored as 1 + w (Gemma's RMSNorm), in fp32
  bool linear = false;              // a projection --quantization fp8 quantizes (not the embedding / LM head)
  bool experts = false;             // a mixture's experts' matrices stacked along dim 0 (MoeWeights), never one GEMM's
  std::vector<float> constant;      // Constant: the values
  std::string missing_hint;         // appended to the error when a piece is missing

  int64_t rows() const;  // summed dim 0 of the pieces (constant: its size)
  int64_t cols() const;  // product of the remaining dims (1 for vectors)
};

// Everything a model definition loads. Weights are referred to by their index here.
struct WeightList {
  std::vector<WeightSpec> specs;
  // Checkpoint tensors the definition knowingly leaves unused (a tied checkpoint's
  // lm_head copy), so that they are not reported.
  std::vector<std::string> known_unused;

  size_t add(WeightSpec s) {
    specs.push_back(std::move(s));
    return specs.size() - 1;
  }
};

// How one piece's values come from its tensor beyond a plain conversion: FP8 codes times
// their scales, or (--quantization fp8) a 16/32-bit tensor quantized to FP8 per row at load.
struct PieceQuant {
  TensorView scale;  // the FP8 codes' scale tensor (F32/F16/BF16, shape checked); info null: none
  Fp8Scaling scaling = Fp8Scaling::Tensor;
  int block_rows = 0, block_cols = 0;  // Block
  bool quantize = false;               // on the fly: per-row FP8 E4M3, absmax / 448
  bool fp8() const { return scale.info != nullptr; }
  explicit operator bool() const { return fp8() || quantize; }
};

// An FP8 piece's scales as [rows][ceil(cols / block)], block = the config's block_cols for block
// scales and cols otherwise (one per row): per-tensor scales repeated, per-channel ones per row,
// block ones per row and column block. What piece_to_f32 multiplies by and a GPU keeps.
std::vector<float> fp8_row_scales(const PieceQuant& q, int64_t rows, int64_t cols);

// The fp32 values of one piece: converted (F32/F16/BF16), FP8 E4M3 codes times their scales,
// or the per-row FP8 round trip of the values (`quantize`) — what a GPU holding FP8 weights
// computes with. `out` holds rows x cols (the tensor's dim 0 x the rest).
void piece_to_f32(const TensorView& v, const PieceQuant& q, std::span<float> out);

// Per-row FP8 E4M3 quantization of w [rows][cols]: scale = absmax / 448 per row (1 for a zero
// row), code = e4m3(w / scale) (round to nearest even, saturating) into `codes`; returns the
// scales. fp8_round_trip_rows replaces w by code * scale in place.
std::vector<float> fp8_quantize_rows(std::span<const float> w, int64_t rows, int64_t cols, std::span<uint8_t> codes);
std::vector<float> fp8_round_trip_rows(std::span<float> w, int64_t rows, int64_t cols);

// What a weight is as a whole, known before any is stored: FP8 (every piece FP8 codes with
// scales, or --quantization fp8 on a projection) with one scale per `scale_block` columns of a
// row (cols: per-tensor / per-channel / quantized at load; block_cols: block-wise), so a
// device that keeps FP8 bytes can size its allocation.
struct SpecQuant {
  bool fp8 = false;
  int scale_block = 0;
  // A matrix that comes as GGUF blocks (WeightSink::store_blocks): each piece's ggml type, in
  // spec order; empty for every other weight.
  std::vector<uint32_t> block_types;
};

// Whether a rank of `world` holds a slice of the spec's tensors rather than the tensors
// themselves (column/row-parallel splits, whole experts): such weights take the dequantized path.
// Whether `world` ranks each hold a part of a weight sharded as `s` (not all of it, or none).
inline bool split_over_ranks(Shard s, int world) {
  return world > 1 && (s == Shard::Rows || s == Shard::Cols || s == Shard::Experts);
}
inline bool sliced_by_tp(const WeightSpec& s, int world) {
  for (const WeightPiece& p : s.pieces)
    if (p.row_count > 0) return true;  // a section of its tensor, at any world size
  return split_over_ranks(s.shard, world);
}

// Where a device puts the weights.
class WeightSink {
 public:
  virtual ~WeightSink() = default;
  // Called once, before any store(), with every spec and its SpecQuant (sizes are known: one
  // allocation).
  virtual void reserve(std::span<const WeightSpec> specs, std::span<const SpecQuant> quant) = 0;
  // One weight. Matrices and biases come as the checkpoint's raw tensors (`pieces`, dtype
  // and shape checked: F32, F16, BF16, or FP8 E4M3 with a scale in `quant`), each with how
  // its values are formed (`quant`, one per piece: piece_to_f32); norms and constants as fp32
  // values (`values`, with add_one applied).
  virtual Weight store(const WeightSpec& spec, std::span<const TensorView> pieces, std::span<const PieceQuant> quant,
                       std::span<const float> values) = 0;
  // Whether the device keeps a matrix stored in GGUF blocks of ggml type `type` as blocks
  // (store_blocks) rather than taking its dequantized values (store). Default: never.
  virtual bool keeps_blocks(uint32_t type) const {
    (void)type;
    return false;
  }
  // A matrix whose every piece is GGUF blocks of a kept type (`pieces` in spec order, each with
  // its rows as the checkpoint stores them: Checkpoint::Blocks::unpermute_heads says how they
  // map). The sink copies what it keeps.
  virtual Weight store_blocks(const WeightSpec& spec, std::span<const Checkpoint::Blocks> pieces);
};

struct LoadedWeights {
  std::vector<Weight> weights;  // one per spec, in order
  size_t num_params = 0;        // elements read from the checkpoint
  size_t block_tensors = 0;     // GGUF tensors handed to the sink as blocks (store_blocks)
};

// The rows of one GGUF block piece in Hugging Face order, copied into `out` (row_bytes each).
void copy_block_rows(const Checkpoint::Blocks& piece, uint8_t* out);

// Loads every weight of `list` from `ckpt` into `sink`. Throws kvlm::Error naming the tensor
// for a missing tensor, a wrong shape, a dtype kvlm cannot load, or an FP8 tensor whose scale
// is missing or mis-shaped for `quant` (the model's FP8 scheme: config.json's, or
// --quantization fp8, which quantizes the linear weights); warns about checkpoint tensors no
// spec uses (other than scales and cached RoPE tables).
//
// With tensor parallelism (`tp.world` > 1) every weight is sliced to what rank `tp.rank`
// holds (Shard, WeightPiece::shard_units) before it reaches the sink, scales included: the
// sink sees specs and tensors of the rank's shapes, and a RankZero weight on another rank is
// not loaded (its Weight is empty). A block-wise FP8 tensor whose rank slice does not start
// on a scale block is refused.
LoadedWeights load_weights(const WeightList& list, const Checkpoint& ckpt, WeightSink& sink,
                           const std::optional<WeightQuantConfig>& quant = std::nullopt, TpRank tp = {});

// The model's compute dtype: config.json's torch_dtype/dtype, else the embedding's dtype.
DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt);

}  // namespace kvlm
