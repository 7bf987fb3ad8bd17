// The model runner interface: weights on one device plus the KV pool they attend over.
//
// The serving engine (engine/llm_engine.h: one request or many) decides which
// pages each sequence owns and lays a step's tokens out as a ForwardBatch; the runner owns
// the pages themselves, sized by allocate_kv, in host memory (CPU) or device memory (CUDA),
// and runs the batch. One block id addresses the same page in every layer's pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "attention/backend.h"
#include "config/model_config.h"
#include "core/index_types.h"
#include "sampling/sampler.h"

namespace kvlm {

// A flattened batch of tokens from one or more sequences.
struct ForwardBatch {
  std::span<const TokenId> tokens;     // [num_tokens]
  std::span<const Position> positions; // [num_tokens]
  std::span<const SlotId> slots;       // [num_tokens]: where each token's K/V goes
  // [num_tokens] where each token's exact copy goes (layers with exact sink / recent tokens:
  // exact page * block_size + offset, -1 = none); empty when no layer keeps exact tokens.
  std::span<const SlotId> exact_slots;
  std::span<const AttnSeq> seqs;       // per sequence: rows, context length, block tables
  std::span<const int32_t> logit_rows; // rows of `tokens` whose next-token logits are wanted
};

// Host memory from ModelRunner::allocate_host (its deleter knows how it was allocated).
using HostBytes = std::unique_ptr<uint8_t[], void (*)(uint8_t*)>;
// Device memory a GPU runner sets aside for the host tier's copies in passing (pages are
// packed there, then moved by DMA); the memory plan counts it.
inline constexpr size_t kPageStagingBytes = size_t(64) << 20;

// One page copy (copy_blocks).
struct PageCopy {
  BlockId src = -1, dst = -1;
  BlockId exact_src = -1, exact_dst = -1;  // exact pages, -1 = none
};

// What the host tier's page copies move (kv_page_bytes, save_pages, load_pages): pages of the
// KV pool, or exact pages (the copies of exact sink / recent tokens, kv/kv_cache.h).
enum class PageKind : uint8_t { Pages, Exact };

// One recurrent-state copy (copy_states): every Gated DeltaNet layer's state of slot src
// onto slot dst.
struct StateCopy {
  int src = -1, dst = -1;
};

// How forward_sampled treats one logit row.
struct RowSampling {
  bool on_device = false;  // false: the row's logits are copied to the host instead
  bool masked = false;     // (on_device rows) only the tokens of the row's mask may be drawn
  SamplingParams params;   // temperature, top-k, top-p, min-p (no penalties)
  uint64_t seed = 0;       // the request's seed
  uint64_t counter = 0;    // the output position of the token being drawn
};

// The token mask of a masked logit row (a grammar's allowed tokens): writes bit t of
// words[t / 64] for each token t that may be drawn and returns true, or returns false when it
// cannot say yet (the mask is still being computed, or no token is allowed) — the row's logits
// then go to the host instead. Called on the runner's thread while the forward pass runs on
// the device, once per masked row; it must not wait for a mask.
using RowMaskFn = std::function<bool(size_t row, std::span<uint64_t> words)>;

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  virtual size_t num_parameters() const = 0;
  // Bytes the weights occupy where they live (host or device).
  virtual size_t weight_bytes() const = 0;

  // (Re)allocates the KV pool as `num_blocks` pages of `block_size` tokens in every layer,
  // each layer sized exactly by its KVLayerSpec, and `num_exact_pages` exact pages in every
  // layer that keeps exact sink / recent tokens (kv/kv_cache.h). Previous contents are
  // discarded.
  virtual void allocate_kv(int num_blocks, int block_size, int num_exact_pages = 0) = 0;
  // The KV plan the runner was built with has been rebuilt in place (LoadedModel::replan_kv:
  // same layers and backends, other formats, rotations or exact tokens): the KV pool is
  // discarded, and the next allocate_kv sizes it for the new plan. Runners that cannot say so.
  virtual void kv_plan_changed();
  virtual int kv_num_blocks() const = 0;
  // Hybrid models (ModelConfig::linear_attention): `slots` recurrent states in every Gated
  // DeltaNet layer, one per running sequence (AttnSeq::state_slot; a sequence whose first row
  // of a step is position 0 starts its state from zeros). Runners of other models ignore it.
  virtual void allocate_states(int slots) { (void)slots; }
  // Copies whole states between slots, in order, after the work already issued and before the
  // next step: the prefix cache's snapshots of hybrid models (engine/state_snapshots.h).
  // Runners of models without states accept no copies.
  virtual void copy_states(std::span<const StateCopy> copies);
  virtual size_t kv_bytes() const = 0;

  // Runs the batch, storing its K/V in the pool; writes fp32 logits
  // [logit_rows.size()][vocab] to host memory — or, in a pooling runner, the rows' final-normed
  // hidden states [logit_rows.size()][hidden] (output_width() values per row).
  virtual void forward(const ForwardBatch& batch, std::span<float> logits) = 0;

  // A pooling runner (an embedding model: --runner pooling) hands back each logit row's
  // hidden state after the final norm, fp32, instead of its logits: what embeddings pool. Set
  // before the first step (it changes what a step computes, CUDA graphs included).
  virtual void set_pooling(bool on) { pooling_ = on; }
  bool pooling() const { return pooling_; }
  // Values per logit row that forward() writes: the vocabulary, or the hidden size when pooling.
  int output_width() const { return pooling_ ? config().hidden_size : config().vocab_size; }

  // Sampling where the logits are (sampling/sampler.h's sample_gumbel), so that a GPU runner
  // returns token ids instead of [rows][vocab] logits. Runs the batch as forward() does; for
  // each logit row i with rows[i].on_device, writes tokens[i]. host_logits has a slot of
  // [vocab] for every row that is not on_device or is masked, in row order: the logits of a
  // row that is not on_device go to its slot; a masked row asks mask(i, ...) for its mask
  // while the forward pass runs and is sampled within it, or, when mask returns false, gets
  // tokens[i] = -1 and its logits in its slot. The base implementation samples on the host
  // after forward(); samples_on_device() says whether the runner does it on its device (the
  // serving engine uses forward_sampled only then).
  virtual bool samples_on_device() const { return false; }
  virtual void forward_sampled(const ForwardBatch& batch, std::span<const RowSampling> rows, std::span<TokenId> tokens,
                               std::span<float> host_logits, const RowMaskFn& mask);

  // Speculative decoding with a drafter loaded into the runner (DFlash). When one is,
  // forward() also keeps the target features the drafter reads and writes the drafter's
  // context K/V for every row of the batch (rows a verification later rejects leave K/V
  // past the sequence's length, overwritten when those positions are computed again).
  // draft() runs drafted blocks — the batch's rows, each sequence's queries attending to its
  // whole context and block (the drafter's layers are non-causal) — and writes the fp32
  // logits of the logit rows; draft_greedy() their argmax (where the logits are).
  virtual bool has_drafter() const { return false; }
  virtual void draft(const ForwardBatch& blocks, std::span<float> logits);
  virtual void draft_greedy(const ForwardBatch& blocks, std::span<TokenId> tokens);

  // Tensor parallelism (model/tensor_parallel.h): a runner of a rank other than 0 runs each
  // step for its share of the K/V and its part in the collectives, and forms no logits (only
  // rank 0 has the LM head). A runner of one rank throws.
  virtual void forward_follower(const ForwardBatch& batch);

  // Why the runner cannot run any more (a tensor-parallel rank or node failed: the ranks' KV
  // may differ), or empty. The serving engine stops when a failed step leaves it broken.
  virtual std::string broken() const { return {}; }

  // Copies whole pages (every layer, K, V and scales) from src to dst, and the exact page
  // exact_src onto exact_dst where both are given: the copy-on-write of a shared prefix page
  // that a sequence is about to write into.
  virtual void copy_blocks(std::span<const PageCopy> copies) = 0;

  // The prefix cache's host tier (engine/host_kv_tier.h): the bytes of one page of `block_size`
  // tokens in every layer — PageKind::Pages: K and V codes and token scales, kv/kv_cache.h's
  // kv_page_bytes(plan) and KVCache::save_page's layout; PageKind::Exact: one exact page (exact
  // sink / recent tokens) in every layer that keeps them, KVCache::save_exact_page's layout, 0
  // without such layers — or 0 when the runner cannot copy pages out (then --kv-offload-gib is
  // refused).
  virtual size_t kv_page_bytes(int block_size, PageKind kind = PageKind::Pages) const {
    (void)block_size;
    (void)kind;
    return 0;
  }
  // Host memory for those copies: pinned on a GPU runner, so that they run at the bus's speed
  // without holding the host; plain memory on the CPU.
  virtual HostBytes allocate_host(size_t bytes);
  // save_pages copies page pages[i] to out[i], load_pages in[i] into page pages[i], each
  // kv_page_bytes(kind) long; with PageKind::Exact, pages[i] are exact page ids. They are
  // ordered after the work already issued and before any later step or copy, and may run
  // asynchronously (a GPU runner): the host reads or writes those buffers itself only after
  // wait_pages().
  virtual void save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out,
                          PageKind kind = PageKind::Pages);
  virtual void load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in,
                          PageKind kind = PageKind::Pages);
  virtual void wait_pages() {}
  // A wait for the copies issued so far, callable later from any thread (the disk tier's
  // writer): it returns once they have completed, whatever was issued after. The default
  // waits for everything (wait_pages).
  virtual std::function<void()> page_fence() {
    return [this] { wait_pages(); };
  }
  // How long those copies took where they ran (a GPU: from each call's first DMA to its last
  // kernel, read from events once they have completed); the host tier counts their bytes.
  struct PageCopyTimes {
    double save_seconds = 0, load_seconds = 0;
  };
  virtual PageCopyTimes page_copy_times() { return page_times_; }
  // The host-to-device bandwidth of pinned memory, bytes/s, measured now (the bench's
  // reference for the tier's restores); 0 where there is no such copy (the CPU).
  virtual double measure_host_to_device_bandwidth() { return 0; }

 protected:
  PageCopyTimes page_times_;


 private:
  bool pooling_ = false;
};

}  // namespace kvlm
