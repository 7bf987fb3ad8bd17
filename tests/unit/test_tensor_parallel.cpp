// Tensor parallelism's arithmetic (model/tensor_parallel.h) — which heads, rows and columns a
// rank holds, for every golden config and N = 1, 2, 4, 8 — its errors, the host communicator,
// and the in-process runner's failure handling. The numerical equality of N ranks with one is
// tests/golden/test_golden.cpp's TensorParallelMatchesOneRank.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "config/model_config.h"
#include "core/error.h"
#include "core/host_threads.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/communicator.h"
#include "model/distributed.h"
#include "model/loaded_model.h"
#include "model/tensor_parallel.h"
#include "model/tp_runner.h"
#include "offline/score.h"
#include "test_util.h"

using namespace kvlm;
namespace fs = std::filesystem;

namespace {

ModelConfig config(int heads, int kv_heads, int inter) {
  ModelConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = inter;
  c.head_dim = 16;
  c.hidden_size = 64;
  return c;
}

}  // namespace

TEST(TensorParallel, ShardUnitsSplitsOrReplicates) {
  // 8 KV heads over 2 ranks: 4 each, in order.
  EXPECT_EQ(shard_units(8, {0, 2}).begin, 0);
  EXPECT_EQ(shard_units(8, {1, 2}).begin, 4);
  EXPECT_EQ(shard_units(8, {1, 2}).count, 4);
  // 2 KV heads over 8 ranks: each held by 4 ranks (ranks 0-3 head 0, 4-7 head 1).
  for (int r = 0; r < 8; ++r) {
    const UnitRange u = shard_units(2, {r, 8});
    EXPECT_EQ(u.count, 1);
    EXPECT_EQ(u.begin, r / 4) << r;
  }
  // Every unit held exactly once when world divides units.
  std::vector<int> held(12, 0);
  for (int r = 0; r < 4; ++r) {
    const UnitRange u = shard_units(12, {r, 4});
    for (int64_t i = u.begin; i < u.begin + u.count; ++i) ++held[size_t(i)];
  }
  for (int h : held) EXPECT_EQ(h, 1);
  EXPECT_ERROR_CONTAINS(shard_units(6, {0, 4}), "cannot be split over 4");
}

TEST(TensorParallel, LayoutOfEveryGoldenConfig) {
  const fs::path golden = fs::path(KVLM_TEST_DATA) / "golden" / "models";
  int checked = 0;
  for (const auto& e : fs::directory_iterator(golden)) {
    const ModelConfig c = load_model_config(e.path());
    for (const int n : {1, 2, 4, 8}) {
      const bool fits = c.num_heads % n == 0 && c.intermediate_size % n == 0 &&
                        (c.num_kv_heads % n == 0 || n % c.num_kv_heads == 0) &&
                        (!c.linear_attention || c.linear_attention->k_heads % n == 0) &&
                        (!c.moe || c.moe->shared_expert_size % n == 0);
      if (!fits) {
        EXPECT_ERROR_CONTAINS(tp_layout(c, n), "cannot split this model");
        continue;
      }
      const TpLayout t = tp_layout(c, n);
      EXPECT_EQ(t.q_heads * n, c.num_heads);
      EXPECT_EQ(t.intermediate * n, c.intermediate_size);
      EXPECT_EQ(t.kv_heads * n, c.num_kv_heads * t.kv_replicas);  // every KV head held kv_replicas times
      // Each rank's query heads read only its KV heads (GQA groups never straddle ranks).
      const int group = c.num_heads / c.num_kv_heads;
      for (int r = 0; r < n; ++r) {
        const int first_q = r * t.q_heads, last_q = first_q + t.q_heads - 1;
        const UnitRange kv = shard_units(c.num_kv_heads, {r, n});
        EXPECT_GE(first_q / group, kv.begin) << e.path() << " n=" << n << " r=" << r;
        EXPECT_LT(last_q / group, kv.begin + kv.count) << e.path() << " n=" << n << " r=" << r;
      }
      const ModelConfig s = shard_config(c, {0, n});
      EXPECT_EQ(s.num_heads, t.q_heads);
      EXPECT_EQ(s.num_kv_heads, t.kv_heads);
      EXPECT_EQ(s.hidden_size, c.hidden_size);
      EXPECT_EQ(s.vocab_size, c.vocab_size);
      if (c.linear_attention) {  // Gated DeltaNet layers by key heads, each with its value heads
        EXPECT_EQ(s.linear_attention->k_heads * n, c.linear_attention->k_heads);
        EXPECT_EQ(s.linear_attention->v_heads * n, c.linear_attention->v_heads);
        EXPECT_EQ(s.linear_attention->state_values() * size_t(n), c.linear_attention->state_values());
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

TEST(TensorParallel, HybridsSplitByLinearKeyHeads) {
  ModelConfig c = load_model_config(fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3.5");
  ASSERT_TRUE(c.linear_attention);
  c.linear_attention->k_heads = 3;
  c.linear_attention->v_heads = 6;
  EXPECT_ERROR_CONTAINS(tp_layout(c, 2), "linear_num_key_heads 3 is not divisible by 2");
  ModelConfig m = load_model_config(fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-next");
  ASSERT_TRUE(m.moe);
  m.moe->shared_expert_size = 50;
  EXPECT_ERROR_CONTAINS(tp_layout(m, 4), "shared_expert_intermediate_size");
}

TEST(TensorParallel, ErrorsNameTheFieldAndTheSizesThatWork) {
  const ModelConfig c = config(4, 2, 128);
  EXPECT_ERROR_CONTAINS(tp_layout(c, 3), "num_attention_heads 4 is not divisible by 3");
  EXPECT_ERROR_CONTAINS(tp_layout(c, 3), "sizes that work: 1, 2, 4");
  EXPECT_ERROR_CONTAINS(tp_layout(config(8, 3, 64), 2), "num_key_value_heads 3 neither divides");
  EXPECT_ERROR_CONTAINS(tp_layout(config(4, 4, 90), 4), "intermediate_size 90 is not divisible by 4");
  EXPECT_ERROR_CONTAINS(tp_layout(c, 0), "at least 1");
  EXPECT_EQ(valid_tp_sizes(config(64, 8, 28672)), "1, 2, 4, 8");
}

// Expert parallelism needs the experts to divide over the ranks (as the heads must), and a
// mixture of experts to split.
TEST(TensorParallel, ExpertParallelSizesMustDivideTheExperts) {
  ModelConfig c = config(8, 8, 64);
  c.moe = MoeConfig{.num_experts = 6, .top_k = 2, .expert_size = 96};
  c.moe_layers.assign(size_t(c.num_layers), true);
  EXPECT_NO_THROW(tp_layout(c, 4)) << "inside the experts: 96 columns over 4";
  c.moe->expert_parallel = true;
  EXPECT_ERROR_CONTAINS(tp_layout(c, 4), "its 6 experts do not divide over 4 ranks (--enable-expert-parallel");
  EXPECT_ERROR_CONTAINS(tp_layout(c, 4), "sizes that work: 1, 2");
  const ModelConfig r1 = shard_config(c, {1, 2});
  EXPECT_EQ(r1.moe->expert_begin, 3);
  EXPECT_EQ(r1.moe->held_experts(), 3);
  EXPECT_EQ(r1.moe->expert_size, 96) << "whole experts";
  ModelConfig dense = config(8, 8, 64);
  EXPECT_ERROR_CONTAINS(apply_expert_parallel(dense, true), "is not a mixture of experts");
}

namespace {

// A copy of golden model `name` (a mixture of experts) that keeps only its first `keep`
// experts and their router rows, so that they divide over the ranks.
fs::path with_experts(const std::string& name, int keep) {
  const fs::path src = fs::path(KVLM_TEST_DATA) / "golden" / "models" / name;
  const fs::path dst = fs::temp_directory_path() / ("kvlm-ep-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::create_directories(dst);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(src / "config.json"));
  const int E = cfg.contains("num_local_experts") ? cfg["num_local_experts"].get<int>() : cfg["num_experts"].get<int>();
  cfg[cfg.contains("num_local_experts") ? "num_local_experts" : "num_experts"] = keep;
  std::ofstream(dst / "config.json") << cfg.dump(2);
  fs::copy_file(src / "generation_config.json", dst / "generation_config.json");
  const Checkpoint ck = Checkpoint::open(src);
  std::vector<TensorToWrite> out;
  for (const std::string& n : ck.names()) {
    const TensorView v = ck.view(n);
    TensorToWrite t{n, v.info->dtype, v.info->shape, v.bytes};
    const size_t experts_at = n.find("mlp.experts.");
    const bool router = n.find("mlp.gate.") != std::string::npos || n.find("mlp.router.") != std::string::npos;
    if (experts_at != std::string::npos && std::isdigit(static_cast<unsigned char>(n[experts_at + 12]))) {
      if (std::stoi(n.substr(experts_at + 12)) >= keep) continue;  // one expert's tensor
    } else if (experts_at != std::string::npos || router) {  // [E][...] fused experts, or the router
      EXPECT_EQ(t.shape[0], E) << n;
      t.shape[0] = keep;
      t.bytes = v.bytes.first(v.bytes.size() / size_t(E) * size_t(keep));
    }
    out.push_back(t);
  }
  write_safetensors(dst / "model.safetensors", out);
  return dst;
}

}  // namespace

// Whole experts per rank give one rank's logits, as splitting every expert's width does: per
// expert tensors (Qwen3-MoE, with a dense layer) and fused ones with biases (GPT-OSS), at 2 and
// 4 ranks; a rank holds only its experts.
TEST(TensorParallel, ExpertParallelMatchesOneRank) {
  for (const std::string name : {"qwen3-moe", "gpt-oss"}) {
    const fs::path dir = with_experts(name, 4);
    auto load = [&](int tp, bool ep) {
      return LoadedModel::load(ModelOptions{
          .model_dir = dir, .dtype = DType::F32, .tensor_parallel_size = tp, .expert_parallel = ep});
    };
    std::vector<TokenId> tokens;
    for (int i = 0; i < 24; ++i) tokens.push_back(TokenId((i * 37 + 11) % 200 + 3));
    const std::vector<float> one = all_logits(*load(1, false), tokens, 5);
    double scale = 0;
    for (float x : one) scale = std::max(scale, double(std::fabs(x)));
    for (const auto& [tp, ep] : {std::pair{2, false}, std::pair{2, true}, std::pair{4, true}}) {
      auto e = load(tp, ep);
      const std::vector<float> got = all_logits(*e, tokens, 5);
      ASSERT_EQ(got.size(), one.size());
      double max_abs = 0;
      for (size_t i = 0; i < got.size(); ++i) max_abs = std::max(max_abs, double(std::fabs(got[i] - one[i])));
      EXPECT_LT(max_abs, 4e-6 * std::max(1.0, scale)) << name << " tp=" << tp << (ep ? " with" : " without")
                                                      << " expert parallelism";
      if (ep) {  // each rank holds 4 / tp of the experts: fewer weights than inside-expert splitting's rank
        auto* r = dynamic_cast<TensorParallelRunner*>(&e->model());
        ASSERT_NE(r, nullptr);
        EXPECT_EQ(e->config().moe->expert_parallel, true);
      }
    }
    fs::remove_all(dir);
  }
}

TEST(TensorParallel, RankPlanHoldsTheRanksHeadsAndScales) {
  KVPlan plan;
  KVLayerSpec l;
  l.attn.num_q_heads = 8;
  l.attn.num_kv_heads = 4;
  l.attn.head_dim = 16;
  l.k = l.v = KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
  l.k_scale = {1, 2, 3, 4};
  l.v_scale = {5, 6, 7, 8};
  plan.layers.push_back(l);
  const KVPlan r1 = shard_kv_plan(plan, {1, 2});
  EXPECT_EQ(r1.layers[0].attn.num_q_heads, 4);
  EXPECT_EQ(r1.layers[0].attn.num_kv_heads, 2);
  EXPECT_EQ(r1.layers[0].k_scale, (std::vector<float>{3, 4}));
  EXPECT_EQ(r1.layers[0].v_scale, (std::vector<float>{7, 8}));
  EXPECT_EQ(r1.bytes_per_token() * 2, plan.bytes_per_token());
  // Fewer KV heads than ranks: rank 5 of 8 holds KV head 2 and its scale.
  const KVPlan r5 = shard_kv_plan(plan, {5, 8});
  EXPECT_EQ(r5.layers[0].attn.num_q_heads, 1);
  EXPECT_EQ(r5.layers[0].attn.num_kv_heads, 1);
  EXPECT_EQ(r5.layers[0].k_scale, (std::vector<float>{3}));
  // A per-layer scale stays one value.
  plan.layers[0].k_scale = {0.5f};
  EXPECT_EQ(shard_kv_plan(plan, {1, 2}).layers[0].k_scale, (std::vector<float>{0.5f}));
}

TEST(TensorParallel, HostGroupSumsInRankOrderOnEveryRank) {
  for (const int n : {1, 2, 3, 4}) {
    HostGroup g(n);
    std::vector<std::vector<float>> bufs(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      bufs[size_t(r)].resize(1001);
      for (size_t i = 0; i < 1001; ++i) bufs[size_t(r)][i] = float(r + 1) * float(i) + 0.25f;
      threads.emplace_back([&, r] {
        for (int rep = 0; rep < 3; ++rep) g.rank(r).all_reduce_sum(bufs[size_t(r)].data(), DType::F32, 1001, nullptr);
      });
    }
    for (auto& t : threads) t.join();
    // After 3 reductions every element is n^2 * (sum of r+1) ... computed directly:
    for (size_t i = 0; i < 1001; ++i) {
      double v = 0;
      for (int r = 0; r < n; ++r) v += double(r + 1) * double(i) + 0.25;
      v *= double(n) * double(n);
      for (int r = 0; r < n; ++r) EXPECT_FLOAT_EQ(bufs[size_t(r)][i], float(v)) << "n=" << n << " i=" << i;
    }
    for (int r = 1; r < n; ++r) EXPECT_EQ(bufs[0], bufs[size_t(r)]);  // the same bits on every rank
  }
}

TEST(TensorParallel, AbortWakesARankWaitingForAPeer) {
  HostGroup g(2);
  std::vector<float> x(8, 1.0f);
  std::atomic<bool> failed{false};
  std::thread waiter([&] {
    try {
      g.rank(0).all_reduce_sum(x.data(), DType::F32, x.size(), nullptr);  // rank 1 never comes
    } catch (const Error& e) {
      failed = std::string(e.what()).find("aborted") != std::string::npos;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g.rank(1).abort();
  waiter.join();
  EXPECT_TRUE(failed);
  EXPECT_ERROR_CONTAINS(g.rank(1).all_reduce_sum(x.data(), DType::F32, x.size(), nullptr), "aborted");
}

namespace {

// A rank that all-reduces once per step, or (broken) throws before its all-reduce while its
// peers wait in theirs.
class FakeRank final : public ModelRunner {
 public:
  FakeRank(Communicator& comm, bool broken) : comm_(comm), broken_(broken) { cfg_.vocab_size = 4; }
  const ModelConfig& config() const override { return cfg_; }
  Device device() const override { return Device::Cpu; }
  size_t num_parameters() const override { return 0; }
  size_t weight_bytes() const override { return 0; }
  void allocate_kv(int n, int, int) override { blocks_ = n; }
  int kv_num_blocks() const override { return blocks_; }
  size_t kv_bytes() const override { return 0; }
  void forward(const ForwardBatch&, std::span<float> logits) override {
    step();
    std::fill(logits.begin(), logits.end(), x_[0]);
  }
  void forward_follower(const ForwardBatch&) override { step(); }
  void copy_blocks(std::span<const PageCopy>) override {}

 private:
  void step() {
    if (broken_) throw Error("rank " + std::to_string(comm_.rank()) + " is broken");
    x_.assign(4, 1.0f);
    comm_.all_reduce_sum(x_.data(), DType::F32, x_.size(), nullptr);
  }
  Communicator& comm_;
  bool broken_;
  ModelConfig cfg_;
  int blocks_ = 0;
  std::vector<float> x_;
};

}  // namespace

TEST(TensorParallel, ARankThatFailsFailsTheGroupInsteadOfHanging) {
  {  // healthy ranks: every call runs on all three, rank 0 returns the sum
    HostGroup g(3);
    std::vector<Communicator*> comms{&g.rank(0), &g.rank(1), &g.rank(2)};
    TensorParallelRunner tp(comms, [&](int r) { return std::make_unique<FakeRank>(*comms[size_t(r)], false); });
    EXPECT_EQ(tp.world_size(), 3);
    tp.allocate_kv(5, 16);
    EXPECT_EQ(tp.kv_num_blocks(), 5);
    std::vector<float> logits(4);
    for (int i = 0; i < 3; ++i) {
      tp.forward(ForwardBatch{}, logits);
      EXPECT_EQ(logits[0], 3.0f);
    }
  }
  // Rank 2 throws while ranks 0 and 1 wait for it in an all-reduce: the call fails with its
  // error (no hang), and every later call says the group failed.
  HostGroup g(3);
  std::vector<Communicator*> comms{&g.rank(0), &g.rank(1), &g.rank(2)};
  TensorParallelRunner tp(comms, [&](int r) { return std::make_unique<FakeRank>(*comms[size_t(r)], r == 2); });
  std::vector<float> logits(4);
  EXPECT_ERROR_CONTAINS(tp.forward(ForwardBatch{}, logits), "rank 2 is broken");
  EXPECT_ERROR_CONTAINS(tp.forward(ForwardBatch{}, logits), "failed earlier (rank 2 is broken)");
}

// Host-side loops of a step take a small team, less the cores a tensor-parallel group keeps
// busy while it lives (core/host_threads.h: a full team stalled host-sampled steps under TP).
TEST(TensorParallel, HostLoopsLeaveTheRanksCoresAlone) {
#if defined(_OPENMP)
  const int max = omp_get_max_threads();
#else
  const int max = 1;
#endif
  const int alone = host_threads::team();
  EXPECT_EQ(alone, std::clamp(max, 1, host_threads::kMaxTeam));
  {
    HostGroup g(3);
    std::vector<Communicator*> comms{&g.rank(0), &g.rank(1), &g.rank(2)};
    TensorParallelRunner tp(comms, [&](int r) { return std::make_unique<FakeRank>(*comms[size_t(r)], false); });
    EXPECT_EQ(host_threads::team(), std::clamp(max - 6, 1, host_threads::kMaxTeam));  // 2 cores per rank
    {
      host_threads::Reservation more(1000);  // more than the machine: still one thread
      EXPECT_EQ(host_threads::team(), 1);
    }
  }
  EXPECT_EQ(host_threads::team(), alone);  // released with the group
}

TEST(TensorParallel, ALoadErrorOfOneRankIsTheLoadError) {
  HostGroup g(2);
  std::vector<Communicator*> comms{&g.rank(0), &g.rank(1)};
  EXPECT_ERROR_CONTAINS(TensorParallelRunner(comms,
                                             [&](int r) -> std::unique_ptr<ModelRunner> {
                                               if (r == 1) throw Error("rank 1 cannot load");
                                               return std::make_unique<FakeRank>(*comms[0], false);
                                             }),
                        "rank 1 cannot load");
}

TEST(TensorParallel, TheModelsRanksHoldTheirShareOfThePool) {
  ModelOptions o;
  o.model_dir = fs::path(KVLM_TEST_DATA) / "golden" / "models" / "llama-gqa";
  o.tensor_parallel_size = 2;
  auto e = LoadedModel::load(o);
  auto* tp = dynamic_cast<TensorParallelRunner*>(&e->model());
  ASSERT_NE(tp, nullptr);
  EXPECT_EQ(e->tensor_parallel_size(), 2);
  EXPECT_EQ(e->rank_plan().bytes_per_token() * 2, e->plan().bytes_per_token());
  e->model().allocate_kv(8, 16);
  EXPECT_EQ(e->model().kv_bytes(), 2 * tp->rank(0).kv_bytes());
  EXPECT_EQ(tp->rank(0).kv_bytes(), size_t(8 * 16) * e->rank_plan().bytes_per_token());
  // Rank 1 has no LM head (llama-gqa's is untied): it holds fewer weights than rank 0, and
  // refuses to form logits.
  EXPECT_LT(tp->rank(1).weight_bytes(), tp->rank(0).weight_bytes());
  std::vector<float> logits(size_t(e->config().vocab_size));
  EXPECT_ERROR_CONTAINS(tp->rank(1).forward(ForwardBatch{}, logits), "rank 0");
}

TEST(TensorParallel, LoadErrorsComeBeforeTheWeights) {
  ModelOptions o;
  o.model_dir = fs::path(KVLM_TEST_DATA) / "golden" / "models" / "llama-gqa";
  o.tensor_parallel_size = 3;
  EXPECT_ERROR_CONTAINS(LoadedModel::load(o), "--tensor-parallel-size 3 cannot split this model");
  o.tensor_parallel_size = 0;
  EXPECT_ERROR_CONTAINS(LoadedModel::load(o), "at least 1");
}

TEST(TensorParallel, BatchesCrossTheWireIntact) {
  const std::vector<TokenId> tok{5, 6, 7};
  const std::vector<Position> pos{10, 11, 0};
  const std::vector<SlotId> slot{int64_t(1) << 33, 17, -1}, exact{3, -1, 4};
  const std::vector<BlockId> t0{4, 9}, t1{2}, e0{1, -1}, e1{};
  const std::vector<AttnSeq> seqs{AttnSeq{.q_begin = 0, .q_len = 2, .kv_len = 12, .block_table = t0, .exact_table = e0},
                                  AttnSeq{.q_begin = 2, .q_len = 1, .kv_len = 1, .block_table = t1, .exact_table = e1}};
  const std::vector<int32_t> rows{1, 2};
  const ForwardBatch b{.tokens = tok, .positions = pos, .slots = slot, .exact_slots = exact, .seqs = seqs, .logit_rows = rows};
  const std::vector<uint8_t> wire = encode_batch(b);
  const OwnedBatch o = decode_batch(wire);
  const ForwardBatch v = o.view();
  EXPECT_TRUE(std::ranges::equal(v.tokens, tok));
  EXPECT_TRUE(std::ranges::equal(v.positions, pos));
  EXPECT_TRUE(std::ranges::equal(v.slots, slot));
  EXPECT_TRUE(std::ranges::equal(v.exact_slots, exact));
  EXPECT_TRUE(std::ranges::equal(v.logit_rows, rows));
  ASSERT_EQ(v.seqs.size(), 2u);
  EXPECT_EQ(v.seqs[0].kv_len, 12);
  EXPECT_TRUE(std::ranges::equal(v.seqs[0].block_table, t0));
  EXPECT_TRUE(std::ranges::equal(v.seqs[0].exact_table, e0));
  EXPECT_TRUE(std::ranges::equal(v.seqs[1].block_table, t1));
  // Damaged bytes are refused, never read past.
  for (size_t cut : {size_t(0), size_t(7), wire.size() / 2, wire.size() - 1})
    EXPECT_ERROR_CONTAINS(decode_batch(std::span(wire).first(cut)), "malformed tensor-parallel command");
  std::vector<uint8_t> longer = wire;
  longer.push_back(0);
  EXPECT_ERROR_CONTAINS(decode_batch(longer), "trailing bytes");
}

TEST(TensorParallel, DistributedConfigFromFlagsOrTorchrunVariables) {
  const DistConfig one = resolve_dist_config(0, -1, "", 600);
  EXPECT_FALSE(one.enabled());
  const DistConfig c = resolve_dist_config(2, 1, "tcp://10.0.0.5:29500", 30);
  EXPECT_EQ(c.nnodes, 2);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.host, "10.0.0.5");
  EXPECT_EQ(c.port, 29500);
  EXPECT_EQ(resolve_dist_config(2, 0, "tcp://[::1]:7000", 30).host, "::1");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 0, "", 30), "needs the leader's address");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 2, "tcp://h:1", 30), "--node-rank 2 is outside 0..1");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 0, "h:1", 30), "is not tcp://HOST:PORT");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 0, "tcp://h:99999", 30), "is not 1..65535");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 0, "tcp://h:x", 30), "is not a number");
  EXPECT_ERROR_CONTAINS(resolve_dist_config(2, 0, "tcp://h:1", 0), "--distributed-timeout must be positive");
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29511", 1);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  const DistConfig t = resolve_dist_config(0, -1, "", 600);
  EXPECT_EQ(t.nnodes, 2);
  EXPECT_EQ(t.node_rank, 1);
  EXPECT_EQ(t.port, 29511);
  EXPECT_EQ(resolve_dist_config(0, 0, "tcp://h:5", 600).node_rank, 0);  // flags win
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}
