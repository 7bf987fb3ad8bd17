// The prefix cache's disk tier (engine/disk_kv_tier.h, --kv-offload-dir): page files round-trip
// byte for byte, survive a restart, and a damaged, truncated, misnamed or foreign file is never
// read (logged, removed); pages named by chain hashes (engine/page_hash.h, SHA-256) reach it
// through the host tier, and the serving engine's greedy tokens are the same with it, across a
// restart of the engine too, while a different KV plan finds nothing of another's.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/sha256.h"
#include "engine/disk_kv_tier.h"
#include "engine/llm_engine.h"
#include "engine/page_hash.h"
#include "host_tier_test_util.h"
#include "serve_test_util.h"

using namespace kvlm;
using namespace kvlm::testing;
namespace fs = std::filesystem;

namespace {

std::string hex(const std::array<uint8_t, 32>& d) {
  std::string s;
  char b[3];
  for (uint8_t x : d) {
    std::snprintf(b, sizeof b, "%02x", x);
    s += b;
  }
  return s;
}

std::array<uint8_t, 32> sha_of(std::string_view s) {
  return sha256(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

// A fresh directory under the test's temporary directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(::testing::TempDir()) / ("kvlm_disk_tier_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

constexpr size_t kPage = 1000;  // not a multiple of the checksum's stripes
constexpr int kTokens = 4;

std::vector<uint8_t> page_bytes(uint8_t tag) {
  std::vector<uint8_t> p(kPage);
  for (size_t i = 0; i < p.size(); ++i) p[i] = uint8_t(tag * 37 + i * 7);
  return p;
}
std::vector<TokenId> page_tokens(int tag) { return {tag, tag + 1, tag + 2, tag + 3}; }
PageHash chain_for(const PageHash& root, int tag) { return page_chain(root, page_tokens(tag)); }

// One page through the reader threads, waited for.
bool read_one(DiskKVTier& d, const PageHash& chain, const std::vector<TokenId>& tokens, uint8_t* dst, uint64_t& serial) {
  d.read_async({DiskKVTier::ReadJob{chain, tokens, dst, 7}});
  std::vector<DiskKVTier::ReadDone> done;
  while (done.empty()) done = d.take_read(/*wait=*/true);
  EXPECT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tag, 7);
  EXPECT_EQ(d.reads_in_flight(), 0u);
  serial = done[0].serial;
  return done[0].ok;
}

uint64_t file_bytes() { return 56 + 4 * kTokens + kPage + 8; }

}  // namespace

TEST(Sha256, MatchesTheFipsExamples) {
  EXPECT_EQ(hex(sha_of("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha_of("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  EXPECT_EQ(hex(sha_of(million)), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Fed in uneven pieces, the same digest.
  Sha256 s;
  for (size_t i = 0, n = 1; i < million.size(); i += n, n = n * 3 % 131 + 1)
    s.update(million.data() + i, std::min(n, million.size() - i));
  EXPECT_EQ(hex(s.finish()), hex(sha_of(million)));
}

TEST(PageHash, ChainsDependOnEveryTokenAndTheRoot) {
  const PageHash a = kv_root("model a"), b = kv_root("model b");
  EXPECT_NE(a, b);
  const std::vector<TokenId> t = {1, 2, 3, 4};
  EXPECT_EQ(page_chain(a, t), page_chain(a, t));
  EXPECT_NE(page_chain(a, t), page_chain(b, t));
  EXPECT_NE(page_chain(a, t), page_chain(a, std::vector<TokenId>{1, 2, 3, 5}));
  EXPECT_NE(page_chain(page_chain(a, t), t), page_chain(a, t)) << "the same tokens one page later";
  EXPECT_EQ(page_chain(a, t).hex().size(), 32u);
}

TEST(DiskTier, PagesRoundTripAndSurviveARestart) {
  const fs::path dir = fresh_dir("restart");
  const PageHash root = kv_root("m");
  {
    DiskKVTier d(dir, 10 * file_bytes(), root, "m", kPage, kTokens);
    EXPECT_EQ(d.capacity(), 10u);
    EXPECT_EQ(d.size(), 0u);
    for (int i = 0; i < 3; ++i) d.write(chain_for(root, i), uint64_t(100 + i), page_tokens(i), page_bytes(uint8_t(i)).data());
    EXPECT_EQ(d.pages_written(), 3u);
    std::vector<uint8_t> got(kPage);
    uint64_t serial = 0;
    ASSERT_TRUE(read_one(d, chain_for(root, 1), page_tokens(1), got.data(), serial));
    EXPECT_EQ(got, page_bytes(1));
    EXPECT_EQ(serial, 101u) << "written by this process: its serial comes back";
    EXPECT_FALSE(read_one(d, chain_for(root, 1), page_tokens(2), got.data(), serial)) << "other tokens never match";
    EXPECT_FALSE(read_one(d, chain_for(root, 7), page_tokens(7), got.data(), serial));
    // A file gone from under the tier is a miss, and leaves the index (only running out of
    // descriptors or memory keeps a file that could not be opened).
    fs::remove(dir / root.hex() / (chain_for(root, 2).hex() + ".kvpage"));
    EXPECT_FALSE(read_one(d, chain_for(root, 2), page_tokens(2), got.data(), serial));
    EXPECT_FALSE(d.contains(chain_for(root, 2)));
    d.write(chain_for(root, 2), 102, page_tokens(2), page_bytes(2).data());
    // A second tier on the same directory and model is refused while this one lives.
    try {
      DiskKVTier twin(dir, 10 * file_bytes(), root, "m", kPage, kTokens);
      FAIL() << "two tiers shared a directory";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another kvlm"), std::string::npos) << e.what();
    }
  }
  DiskKVTier d(dir, 10 * file_bytes(), root, "m", kPage, kTokens);
  EXPECT_EQ(d.loaded_at_start(), 3u);
  for (int i = 0; i < 3; ++i) {
    std::vector<uint8_t> got(kPage);
    uint64_t serial = 7;
    ASSERT_TRUE(read_one(d, chain_for(root, i), page_tokens(i), got.data(), serial)) << i;
    EXPECT_EQ(got, page_bytes(uint8_t(i)));
    EXPECT_EQ(serial, 0u) << "an earlier process's serials mean nothing now";
  }
  // Another model or plan (another root) sees none of them.
  DiskKVTier other(dir, 10 * file_bytes(), kv_root("n"), "n", kPage, kTokens);
  EXPECT_EQ(other.size(), 0u);
  EXPECT_TRUE(fs::exists(dir / root.hex() / "model.txt"));
  EXPECT_EQ(fs::status(dir / root.hex()).permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none)
      << "other users must not read what prompts computed";
  for (const auto& de : fs::directory_iterator(dir / root.hex()))
    if (de.path().extension() == ".kvpage")
      EXPECT_EQ(de.status().permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
}

TEST(DiskTier, ReplacesTheLeastRecentlyUsedAndKeepsWithinItsSize) {
  const fs::path dir = fresh_dir("lru");
  const PageHash root = kv_root("m");
  {
    DiskKVTier d(dir, 3 * file_bytes() + 5, root, "m", kPage, kTokens);
    ASSERT_EQ(d.capacity(), 3u);
    // Apart by more than the file system's clock tick (a few ms), so that the modification
    // times a restart sorts by are apart too.
    auto tick = [] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); };
    for (int i = 0; i < 3; ++i, tick()) d.write(chain_for(root, i), 1, page_tokens(i), page_bytes(uint8_t(i)).data());
    std::vector<uint8_t> got(kPage);
    uint64_t serial = 0;
    ASSERT_TRUE(read_one(d, chain_for(root, 0), page_tokens(0), got.data(), serial));  // 0 is now the most recent
    tick();
    d.write(chain_for(root, 3), 1, page_tokens(3), page_bytes(3).data());
    EXPECT_EQ(d.size(), 3u);
    EXPECT_EQ(d.evictions(), 1u);
    EXPECT_FALSE(d.contains(chain_for(root, 1))) << "the least recently used goes first";
    EXPECT_TRUE(d.contains(chain_for(root, 0)));
    d.write(chain_for(root, 3), 1, page_tokens(3), page_bytes(3).data());  // already there: not written again
    EXPECT_EQ(d.pages_written(), 4u);
  }
  size_t files = 0;
  for (const auto& de : fs::directory_iterator(dir / root.hex())) files += de.path().extension() == ".kvpage";
  EXPECT_EQ(files, 3u) << "replaced pages' files are removed";
  DiskKVTier smaller(dir, 2 * file_bytes(), root, "m", kPage, kTokens);  // a smaller size at restart
  EXPECT_EQ(smaller.size(), 2u);
  EXPECT_FALSE(smaller.contains(chain_for(root, 2))) << "the least recently used file goes";
  EXPECT_TRUE(smaller.contains(chain_for(root, 0))) << "a read made it recent, also for a restart";
}

TEST(DiskTier, DamagedTruncatedMisnamedAndForeignFilesAreIgnored) {
  const fs::path dir = fresh_dir("damaged");
  const PageHash root = kv_root("m"), other = kv_root("other model");
  const fs::path mine = dir / root.hex();
  {
    DiskKVTier d(dir, 20 * file_bytes(), root, "m", kPage, kTokens);
    for (int i = 0; i < 6; ++i) d.write(chain_for(root, i), 1, page_tokens(i), page_bytes(uint8_t(i)).data());
    DiskKVTier o(dir, 20 * file_bytes(), other, "other", kPage, kTokens);
    o.write(chain_for(other, 9), 1, page_tokens(9), page_bytes(9).data());
  }
  auto file = [&](const PageHash& c) { return mine / (c.hex() + ".kvpage"); };
  auto flip = [](const fs::path& p, size_t at) {
    std::string bytes;
    {
      std::ifstream in(p, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    bytes[at] = char(bytes[at] ^ 0x20);
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  };
  // Found at start: 1 truncated; 2 renamed to another page's name; 3 replaced by another
  // model's file (its header names the other root); a stray temporary; a junk file.
  fs::resize_file(file(chain_for(root, 1)), file_bytes() - 9);
  fs::rename(file(chain_for(root, 2)), file(chain_for(root, 42)));
  fs::remove(file(chain_for(root, 3)));
  fs::copy_file(dir / other.hex() / (chain_for(other, 9).hex() + ".kvpage"), file(chain_for(root, 3)));
  std::ofstream(mine / "x.kvpage.tmp") << "half a page";
  std::ofstream(file(chain_for(root, 44))) << "not a page at all";
  // Found when read (false: the host tier frees the slot it read into, unread): 0 with a flipped byte in its page, 4 with a flipped token (its index
  // entry, read at start, still names the right tokens), 5 with a flipped checksum.
  flip(file(chain_for(root, 0)), 56 + 4 * kTokens + 500);

  DiskKVTier d(dir, 20 * file_bytes(), root, "m", kPage, kTokens);
  EXPECT_EQ(d.damaged(), 4u) << "truncated, misnamed, foreign, junk";
  EXPECT_EQ(d.size(), 3u);
  EXPECT_FALSE(fs::exists(mine / "x.kvpage.tmp"));
  EXPECT_FALSE(fs::exists(file(chain_for(root, 1))));
  EXPECT_TRUE(fs::exists(dir / other.hex() / (chain_for(other, 9).hex() + ".kvpage"))) << "other models' pages are left alone";
  flip(file(chain_for(root, 4)), 56 + 4);
  flip(file(chain_for(root, 5)), file_bytes() - 3);
  std::vector<uint8_t> got(kPage, 0xcc);
  uint64_t serial = 0;
  for (int i : {0, 4, 5}) {
    EXPECT_FALSE(read_one(d, chain_for(root, i), page_tokens(i), got.data(), serial)) << i;
    EXPECT_FALSE(d.contains(chain_for(root, i)));
    EXPECT_FALSE(fs::exists(file(chain_for(root, i))));
  }
  EXPECT_EQ(d.damaged(), 7u);
  EXPECT_EQ(d.size(), 0u);
}

TEST(DiskTier, RefusesWhatCannotWork) {
  const fs::path dir = fresh_dir("refuse");
  try {
    DiskKVTier d(dir, file_bytes() - 1, kv_root("m"), "m", kPage, kTokens);
    FAIL() << "a tier smaller than a page";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds no page"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "file") << "x";
  try {
    DiskKVTier d(dir / "file", 10 * file_bytes(), kv_root("m"), "m", kPage, kTokens);
    FAIL() << "a directory under a file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-offload-dir: cannot create"), std::string::npos) << e.what();
  }
}

// Through the engine: a host tier of 12 pages (a conversation's prompt has up to 8) over a disk tier, on the multi-turn workload whose
// pool cannot keep the conversations: the tokens are the large pool's, pages come back from
// disk, and the tier computes no more prompt tokens than the large pool.
TEST(DiskTier, GreedyTokensUnchangedThroughTheDisk) {
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load(kStories, dt, kTierBlock);
    const fs::path dir = fresh_dir("engine");
    const Workload all = run_conversations(*e, 400, 0, 6, 3);
    const Workload disk = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20);
    EXPECT_EQ(disk.outputs, all.outputs);
    EXPECT_GT(disk.stats.kv_offload_disk_written_total, 0u);
    EXPECT_GT(disk.stats.kv_offload_disk_read_total, 0u) << "the host tier is too small: hits must come from disk";
    EXPECT_EQ(disk.stats.kv_offload_disk_damaged_total, 0u);
    EXPECT_EQ(disk.stats.prompt_tokens_total, all.stats.prompt_tokens_total) << "the tiers hold what the pool evicted";
    EXPECT_LE(disk.stats.kv_offload_pages, 12);
    std::printf("[disk tier] %s: %llu pages written, %llu read back; prompt tokens computed %llu (large pool %llu)\n",
                std::string(kv_cache_dtype_name(dt)).c_str(), (unsigned long long)disk.stats.kv_offload_disk_written_total,
                (unsigned long long)disk.stats.kv_offload_disk_read_total,
                (unsigned long long)disk.stats.prompt_tokens_total, (unsigned long long)all.stats.prompt_tokens_total);
  }
}

// A restart: an engine serves prompts and stops (its cached pages go to disk); a new engine on
// the same model and directory finds them and computes only what is new, with the same tokens
// as an engine without tiers; an engine with another KV plan finds none of them; a page file
// damaged while the server was down is ignored and its tokens recomputed.
TEST(DiskTier, PagesSurviveARestartForTheSameModelAndPlanOnly) {
  auto e = load(kStories, KVCacheDType::Int8PerTokenHead, kTierBlock);
  const int vocab = e->config().vocab_size;
  const fs::path dir = fresh_dir("engine_restart");
  std::mt19937 rng(5);
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(rng, 5 * kTierBlock + 3, vocab));
  struct Run {
    std::vector<std::vector<TokenId>> tokens;
    EngineStats stats;
  };
  auto serve = [&](LoadedModel& m, bool tiers) {
    LLMEngine le(m, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 32, .max_model_len = 128,
                                    .enable_prefix_caching = true, .num_blocks = 40,
                                    .kv_offload_pages = tiers ? 8 : 0, .kv_offload_dir = tiers ? dir.string() : "",
                                    .kv_offload_disk_bytes = tiers ? 64u << 20 : 0});
    Run r;
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::map<std::string, Collected> out;
      le.add_request(make("p", prompts[i], 6, out));
      run_to_end(le);
      r.tokens.push_back(out["p"].tokens);
    }
    r.stats = le.stats();
    return r;
  };
  const Run plain = serve(*e, false);
  const Run first = serve(*e, true);  // stops: the pool's cached pages go to disk
  EXPECT_EQ(first.tokens, plain.tokens);
  EXPECT_EQ(first.stats.kv_offload_disk_read_total, 0u);
  const Run second = serve(*e, true);
  EXPECT_EQ(second.tokens, plain.tokens);
  const uint64_t full_pages = uint64_t(prompts.size()) * 5;
  EXPECT_EQ(second.stats.kv_offload_disk_read_total, full_pages) << "every full prompt page comes from disk";
  EXPECT_EQ(second.stats.prompt_tokens_total + full_pages * kTierBlock, plain.stats.prompt_tokens_total);

  // Another plan on the same directory: nothing of the first's is found.
  auto other = load(kStories, KVCacheDType::Int4PerTokenHead, kTierBlock);
  const Run foreign = serve(*other, true);
  EXPECT_EQ(foreign.stats.kv_offload_disk_read_total, 0u);
  EXPECT_EQ(foreign.stats.kv_offload_disk_damaged_total, 0u) << "another plan's pages are in a directory of their own";

  // One damaged file: its page and those after it are computed; the tokens do not change.
  const PageHash root = kv_root(e->kv_identity());
  const fs::path victim = dir / root.hex() / (page_chain(root, std::span(prompts[0]).first(kTierBlock)).hex() + ".kvpage");
  ASSERT_TRUE(fs::exists(victim));
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
    f.seekp(201);
    f.put('\x01');
  }
  const Run third = serve(*e, true);
  EXPECT_EQ(third.tokens, plain.tokens);
  EXPECT_EQ(third.stats.kv_offload_disk_damaged_total, 1u);
  // The first prompt's chain starts at the damaged page: all of it is computed. (Its pages 1-4
  // were read anyway: a hit's pages are read together, up to 7 of the host tier's 8 slots.)
  EXPECT_EQ(third.stats.prompt_tokens_total + (full_pages - 5) * kTierBlock, plain.stats.prompt_tokens_total);
  EXPECT_EQ(third.stats.kv_offload_disk_read_total, full_pages - 5 + 4);
}

// The tiers' cost model (engine/tier_costs.h): unmeasured, both tiers are used; measured, a
// tier is used while bringing a page back costs no more than computing its tokens (a disk page
// pays its read and its copy back from host memory), with a margin either way before the
// decision flips; the figures are moving averages over increments of the totals; steps of
// decode size do not count, and a tier found not to pay is tried again every kProbeEvery
// decisions unless its figure is assumed.
TEST(DiskTier, TiersAreUsedWhileRestoringPays) {
  TierCosts c(16);
  using T = TierCosts::Tier;
  EXPECT_TRUE(c.decide().host);
  EXPECT_TRUE(c.decide().disk);
  c.note_step(1.0, 64);  // decode-sized: ignored
  EXPECT_FALSE(c.recompute_per_page());
  c.note_step(0.5, 1000);  // 0.5 ms a row: 8 ms a page
  ASSERT_TRUE(c.recompute_per_page());
  EXPECT_DOUBLE_EQ(*c.recompute_per_page(), 0.008);
  c.note_restores(T::Host, 1.0, 10);  // fewer than kMinPages: not believed yet
  EXPECT_FALSE(c.restore_per_page(T::Host));
  c.note_restores(T::Host, 0.016, 16);  // totals that went down: counted afresh, 1 ms a page
  ASSERT_TRUE(c.restore_per_page(T::Host));
  EXPECT_DOUBLE_EQ(*c.restore_per_page(T::Host), 0.001);
  c.note_restores(T::Disk, 0.144, 16);  // 9 ms a page, + 1 ms from host = 10 ms: within the margin
  TierCosts::Use u = c.decide();
  EXPECT_TRUE(u.host);
  EXPECT_TRUE(u.disk);
  c.note_restores(T::Disk, 0.146, 18);  // 2 pages more: too few for a sample
  EXPECT_DOUBLE_EQ(*c.restore_per_page(T::Disk), 0.009);
  c.note_restores(T::Disk, 0.204, 20);  // 4 pages at 15 ms: 0.8 * 9 + 0.2 * 15 = 10.2 ms, + 1 > 1.25 * 8
  EXPECT_NEAR(*c.restore_per_page(T::Disk), 0.0102, 1e-12);
  u = c.decide();
  EXPECT_TRUE(u.host);
  EXPECT_FALSE(u.disk);
  c.note_restores(T::Disk, 0.232, 24);  // 4 pages at 7 ms: 9.56 ms, + 1 still above 0.8 * 8 ms
  EXPECT_FALSE(c.decide().disk) << "back on only below the lower margin";
  int probes = 0;
  for (uint64_t i = 0; i < 2 * TierCosts::kProbeEvery; ++i) probes += c.decide().disk ? 1 : 0;
  EXPECT_EQ(probes, 2) << "a tier that does not pay is tried again every kProbeEvery decisions";
  c.note_step(0.01, 1000);  // faster steps pull the moving average down: 0.8 * 0.5 + 0.2 * 0.01 ms a row
  EXPECT_NEAR(*c.recompute_per_page(), 16 * (0.8 * 0.5e-3 + 0.2 * 0.01e-3), 1e-12);
  c.assume(T::Host, 1.0);
  EXPECT_FALSE(c.decide().host);
  probes = 0;
  for (uint64_t i = 0; i < 2 * TierCosts::kProbeEvery; ++i) probes += c.decide().host ? 1 : 0;
  EXPECT_EQ(probes, 0) << "an assumed figure is not probed";
  c.assume(T::Host, -1);
  EXPECT_TRUE(c.decide().host);
}

// The serving engine follows the decision: with reading a page from disk assumed slower than
// computing it, hits stop at the host tier's pages and read nothing from disk; with restores
// from host memory assumed slow (every disk page passes through them), nothing is restored at
// all — and the tokens are the same every way.
TEST(DiskTier, HitsComputeWhatTheTiersCannotBringBackFasterThanARecompute) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kTierBlock);
  const fs::path dir = fresh_dir("engine_costs");
  const Workload all = run_conversations(*e, 400, 0, 6, 3);
  const Workload disk = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20);
  fs::remove_all(dir);
  const Workload slow_disk = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20, 0, 0, [](LLMEngine& le) {
    le.tier_costs().assume_recompute(1e-3);
    le.tier_costs().assume(TierCosts::Tier::Disk, 1.0);
  });
  fs::remove_all(dir);
  const Workload slow_host = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20, 0, 0, [](LLMEngine& le) {
    le.tier_costs().assume_recompute(1e-3);
    le.tier_costs().assume(TierCosts::Tier::Host, 1.0);
  });
  EXPECT_EQ(disk.outputs, all.outputs);
  EXPECT_EQ(slow_disk.outputs, all.outputs);
  EXPECT_EQ(slow_host.outputs, all.outputs);
  EXPECT_GT(disk.stats.kv_offload_disk_read_total, 0u);
  EXPECT_EQ(slow_disk.stats.kv_offload_disk_read_total, 0u) << "a disk slower than recomputing is not read";
  EXPECT_FALSE(slow_disk.stats.kv_offload_disk_in_use);
  EXPECT_TRUE(slow_disk.stats.kv_offload_host_in_use);
  EXPECT_GT(slow_disk.stats.kv_offload_restored_total, 0u) << "the host tier's pages still come back";
  EXPECT_GT(slow_disk.stats.prompt_tokens_total, disk.stats.prompt_tokens_total);
  EXPECT_EQ(slow_host.stats.kv_offload_restored_total, 0u);
  EXPECT_FALSE(slow_host.stats.kv_offload_host_in_use);
  EXPECT_GT(slow_host.stats.prompt_tokens_total, slow_disk.stats.prompt_tokens_total);
  EXPECT_GT(slow_host.stats.kv_offload_stored_total, 0u) << "pages are still kept, for when restoring pays again";
  std::printf("[tier costs] prompt tokens computed: %llu with both tiers, %llu with a slow disk, %llu with slow restores "
              "(large pool %llu)\n",
              (unsigned long long)disk.stats.prompt_tokens_total, (unsigned long long)slow_disk.stats.prompt_tokens_total,
              (unsigned long long)slow_host.stats.prompt_tokens_total, (unsigned long long)all.stats.prompt_tokens_total);

  // Unassumed, the engine measures recomputing from its prompt-sized steps.
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 512, .max_model_len = 400,
                                   .enable_prefix_caching = true, .num_blocks = 80, .kv_offload_pages = 8});
  std::mt19937 rng(3);
  std::map<std::string, Collected> out;
  le.add_request(make("long", random_prompt(rng, 300, e->config().vocab_size), 2, out));
  run_to_end(le);
  EXPECT_GT(le.stats().kv_offload_recompute_page_seconds, 0) << "a 300-row prefill step is measured";
}

// Exact sink / recent tokens across a restart: the exact copies of each prompt's sinks and of
// the window before its last full page go to a disk tier of their own (another root, another
// directory) and come back with the pages, so the same prompts after a restart hit on all their
// full pages; without exact pages in the tiers the hits end before those pages. A damaged exact
// page file is ignored like any other: that prompt's hit ends before the page, tokens unchanged.
TEST(DiskTier, ExactPagesSurviveARestart) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kTierBlock, 3, 11);
  const int vocab = e->config().vocab_size;
  const fs::path dir = fresh_dir("engine_restart_exact");
  std::mt19937 rng(6);
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(rng, 5 * kTierBlock + 3, vocab));
  // `found_on_disk`: exact pages read from disk in admission (find()), not ahead of it.
  auto serve = [&](bool tiers, int64_t exact_pages, uint64_t* found_on_disk = nullptr) {
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 32, .max_model_len = 128,
                                     .enable_prefix_caching = true, .num_blocks = 40,
                                     .kv_offload_pages = tiers ? 8 : 0, .kv_offload_dir = tiers ? dir.string() : "",
                                     .kv_offload_disk_bytes = tiers ? 64u << 20 : 0,
                                     .kv_offload_exact_pages = exact_pages,
                                     .kv_offload_exact_disk_bytes = exact_pages > 0 ? 64u << 20 : 0});
    std::pair<std::vector<std::vector<TokenId>>, EngineStats> r;
    for (const auto& p : prompts) {
      std::map<std::string, Collected> out;
      le.add_request(make("p", p, 6, out));
      run_to_end(le);
      r.first.push_back(out["p"].tokens);
    }
    r.second = le.stats();
    if (found_on_disk) *found_on_disk = le.blocks().exact_tier()->reads_found_on_disk();
    return r;
  };
  const auto [plain, plain_st] = serve(false, 0);
  const auto [first, first_st] = serve(true, 6);
  EXPECT_EQ(first, plain);
  uint64_t found_on_disk = 1;
  const auto [second, second_st] = serve(true, 6, &found_on_disk);
  EXPECT_EQ(second, plain);
  const uint64_t full_pages = uint64_t(prompts.size()) * 5;
  EXPECT_EQ(second_st.prompt_tokens_total + full_pages * kTierBlock, plain_st.prompt_tokens_total)
      << "every full prompt page, and the exact copies its query reads, come from disk";
  // Page 0 (sinks) and pages 3-4 (the window before token 40) of each prompt.
  EXPECT_EQ(second_st.kv_offload_exact_restored_total, uint64_t(prompts.size()) * 3);
  // Read with the pages, while the request waited aside ("restoring"), not one by one when it
  // was admitted.
  EXPECT_EQ(second_st.kv_offload_exact_disk_read_total, uint64_t(prompts.size()) * 3);
  EXPECT_EQ(found_on_disk, 0u) << "exact pages read from disk during admission";
  const PageHash exact_root = kv_root(e->kv_identity() + "\nexact sink / recent pages");
  ASSERT_TRUE(fs::is_directory(dir / exact_root.hex())) << "exact pages in a directory of their own";

  // Without exact pages in the tiers, the pages come back but every hit ends at once: page 0
  // is read exact and has no exact copy.
  const auto [bare, bare_st] = serve(true, 0);
  EXPECT_EQ(bare, plain);
  EXPECT_EQ(bare_st.prompt_tokens_total, plain_st.prompt_tokens_total);

  // A damaged exact page file (prompt 0's page 0, its sinks): that hit ends at once.
  const fs::path victim = dir / exact_root.hex() /
                          (page_chain(kv_root(e->kv_identity()), std::span(prompts[0]).first(kTierBlock)).hex() + ".kvpage");
  ASSERT_TRUE(fs::exists(victim)) << "prompt 0's page 0 has its exact copy on disk";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300);
    f.put('\x55');
  }
  const auto [third, third_st] = serve(true, 6);
  EXPECT_EQ(third, plain);
  EXPECT_EQ(third_st.kv_offload_disk_damaged_total, 0u) << "the pages' tier holds no damaged file";
  EXPECT_EQ(third_st.kv_offload_exact_disk_damaged_total, 1u) << "the damaged exact page was found and removed";
  EXPECT_GT(second_st.kv_offload_exact_disk_read_total, 0u);
  EXPECT_EQ(third_st.prompt_tokens_total + (full_pages - 5) * kTierBlock, plain_st.prompt_tokens_total)
      << "prompt 0's sinks have no exact copy: its hit ends at once";
}

// A request whose prefix is on disk is "restoring": the step that meets it starts its reads and
// runs the others without it; it is admitted once its pages are here, with the tokens an engine
// without tiers gives. With nothing else to run, the scheduler waits for the reads instead.
TEST(DiskTier, ARequestWaitsForItsPagesFromDiskWhileOthersRun) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kTierBlock);
  const int vocab = e->config().vocab_size;
  const fs::path dir = fresh_dir("engine_restoring");
  std::mt19937 rng(11);
  const std::vector<TokenId> cached = random_prompt(rng, 6 * kTierBlock + 2, vocab);
  const std::vector<TokenId> other = random_prompt(rng, kTierBlock + 3, vocab);
  auto engine = [&](bool tiers) {
    return std::make_unique<LLMEngine>(
        *e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 128,
                            .enable_prefix_caching = true, .num_blocks = 40, .kv_offload_pages = tiers ? 16 : 0,
                            .kv_offload_dir = tiers ? dir.string() : "", .kv_offload_disk_bytes = tiers ? 64u << 20 : 0});
  };
  std::map<std::string, Collected> plain;
  {
    auto le = engine(false);
    le->add_request(make("c", cached, 8, plain));
    le->add_request(make("o", other, 24, plain));
    run_to_end(*le);
  }
  {
    auto le = engine(true);  // writes the cached prompt's pages to disk when it stops
    std::map<std::string, Collected> out;
    le->add_request(make("c", cached, 8, out));
    run_to_end(*le);
    EXPECT_EQ(out["c"].tokens, plain["c"].tokens);
  }
  {
  auto le = engine(true);
  std::map<std::string, Collected> out;
  le->add_request(make("o", other, 24, out));
  ASSERT_TRUE(le->step());  // "o" prefills and runs
  le->add_request(make("c", cached, 8, out));
  const size_t before = out["o"].tokens.size();
  ASSERT_TRUE(le->step());
  EngineStats st = le->stats();
  EXPECT_EQ(st.num_restoring, 1) << "its pages are being read: it waits";
  EXPECT_EQ(st.kv_offload_disk_restoring_total, 1u);
  EXPECT_EQ(out["o"].tokens.size(), before + 1) << "the other request's step did not wait for the disk";
  EXPECT_TRUE(out["c"].tokens.empty());
  run_to_end(*le);
  st = le->stats();
  EXPECT_EQ(out["c"].tokens, plain["c"].tokens);
  EXPECT_EQ(out["o"].tokens, plain["o"].tokens);
  EXPECT_EQ(st.num_restoring, 0);
  EXPECT_EQ(st.kv_offload_disk_restoring_total, 1u) << "counted once per request";
  EXPECT_EQ(st.kv_offload_disk_read_total, 6u) << "every full page of its prompt came from disk";
  EXPECT_EQ(st.prefix_cache_hits_total, 6u * kTierBlock);
  }

  // --scheduling-policy priority: while a request waits for its pages, no worse one is admitted.
  {
    auto le = std::make_unique<LLMEngine>(
        *e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 128,
                            .enable_prefix_caching = true, .num_blocks = 40, .priority = true,
                            .kv_offload_pages = 16, .kv_offload_dir = dir.string(), .kv_offload_disk_bytes = 64u << 20});
    std::map<std::string, Collected> pout;
    EngineRequest o = make("o", other, 24, pout);
    o.priority = 0;
    le->add_request(std::move(o));
    ASSERT_TRUE(le->step());
    EngineRequest c = make("c", cached, 8, pout);
    c.priority = 0;
    le->add_request(std::move(c));
    EngineRequest w = make("w", random_prompt(rng, 10, vocab), 4, pout);
    w.priority = 1;
    le->add_request(std::move(w));
    ASSERT_TRUE(le->step());
    EXPECT_EQ(le->stats().num_restoring, 1);
    EXPECT_TRUE(pout["w"].tokens.empty()) << "a worse priority went ahead of a request waiting for its pages";
    run_to_end(*le);
    EXPECT_EQ(pout["c"].tokens, plain["c"].tokens);
    EXPECT_EQ(pout["w"].tokens.size(), 4u);
  }

  // Alone, it does not wait a step: the scheduler waits for the reads and admits it at once.
  auto alone = engine(true);
  std::map<std::string, Collected> out2;
  alone->add_request(make("c", cached, 8, out2));
  ASSERT_TRUE(alone->step());
  EXPECT_EQ(out2["c"].tokens.size(), 1u) << "prefilled from its restored pages in the first step";
  run_to_end(*alone);
  EXPECT_EQ(out2["c"].tokens, plain["c"].tokens);
  EXPECT_EQ(alone->stats().kv_offload_disk_restoring_total, 1u);
}

// Several pages read at once on reader threads: each checked on its own, a damaged one (and one
// the tier does not hold) reported without touching the others.
TEST(DiskTier, ReadsManyPagesAtOnce) {
  const fs::path dir = fresh_dir("many");
  const PageHash root = kv_root("m");
  DiskKVTier d(dir, 20 * file_bytes(), root, "m", kPage, kTokens);
  for (int i = 0; i < 9; ++i) d.write(chain_for(root, i), uint64_t(50 + i), page_tokens(i), page_bytes(uint8_t(i)).data());
  {
    std::fstream f(dir / root.hex() / (chain_for(root, 3).hex() + ".kvpage"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300);
    f.put('\x11');
    f.put('\x22');
  }
  std::vector<std::vector<uint8_t>> bufs(10, std::vector<uint8_t>(kPage));
  std::vector<std::vector<TokenId>> toks;
  for (int i = 0; i < 10; ++i) toks.push_back(page_tokens(i));
  std::vector<DiskKVTier::ReadJob> jobs;
  for (int i = 0; i < 10; ++i) jobs.push_back({chain_for(root, i), toks[size_t(i)], bufs[size_t(i)].data(), 100 + i});  // 9: not held
  d.read_async(jobs);
  EXPECT_EQ(d.reads_in_flight(), 9u) << "the page the tier does not hold is not read";
  std::vector<bool> ok(10, false), seen(10, false);
  std::vector<uint64_t> serials(10, 0);
  for (int got = 0; got < 10;)
    for (const DiskKVTier::ReadDone& r : d.take_read(/*wait=*/true)) {
      const size_t i = size_t(r.tag - 100);
      ASSERT_LT(i, 10u);
      EXPECT_FALSE(seen[i]) << "read " << i << " reported twice";
      seen[i] = true;
      ok[i] = r.ok;
      serials[i] = r.serial;
      ++got;
    }
  EXPECT_EQ(d.reads_in_flight(), 0u);
  EXPECT_TRUE(d.take_read().empty());
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(ok[size_t(i)], i != 3 && i != 9) << i;
    if (ok[size_t(i)]) {
      EXPECT_EQ(bufs[size_t(i)], page_bytes(uint8_t(i))) << i;
      EXPECT_EQ(serials[size_t(i)], uint64_t(50 + i));
    }
  }
  EXPECT_EQ(d.pages_read(), 8u);
  EXPECT_EQ(d.damaged(), 1u);
  EXPECT_FALSE(d.contains(chain_for(root, 3)));
}

// The writer thread: a batch larger than the tier writes its newest pages only and gives every
// buffer back; the fence runs once, before any write; a page about to be read (touched) is
// not the one room is made from.
TEST(DiskTier, WritesInTheBackgroundWithinItsSize) {
  const fs::path dir = fresh_dir("async");
  const PageHash root = kv_root("m");
  DiskKVTier d(dir, 3 * file_bytes(), root, "m", kPage, kTokens);
  std::vector<std::vector<uint8_t>> src;
  for (int i = 0; i < 5; ++i) src.push_back(page_bytes(uint8_t(i)));
  std::vector<DiskKVTier::WriteJob> jobs;
  for (int i = 0; i < 5; ++i) jobs.push_back({chain_for(root, i), 7, page_tokens(i), src[size_t(i)].data(), 100 + i});
  std::atomic<int> fenced = 0;
  d.write_async(std::move(jobs), [&] { ++fenced; });
  std::vector<int> tags;
  while (d.writes_in_flight() > 0 || tags.size() < 5)
    for (int t : d.take_written(/*wait=*/true)) tags.push_back(t);
  std::ranges::sort(tags);
  EXPECT_EQ(tags, (std::vector<int>{100, 101, 102, 103, 104})) << "every buffer comes back";
  EXPECT_EQ(fenced.load(), 1);
  EXPECT_EQ(d.size(), 3u);
  for (int i = 2; i < 5; ++i) EXPECT_TRUE(d.contains(chain_for(root, i))) << "the newest are kept: " << i;
  d.touch(chain_for(root, 2));  // about to be read: 3 is the least recently used now
  d.write(chain_for(root, 5), 7, page_tokens(5), page_bytes(5).data());
  EXPECT_TRUE(d.contains(chain_for(root, 2)));
  EXPECT_FALSE(d.contains(chain_for(root, 3)));
  size_t files = 0;
  for (const auto& de : fs::directory_iterator(dir / root.hex())) files += de.path().extension() == ".kvpage";
  EXPECT_EQ(files, 3u);
}
