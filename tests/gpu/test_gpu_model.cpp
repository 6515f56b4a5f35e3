// The whole model on the GPU: the transformers fixtures of test_forward.cpp (full
// forward, prefill then decode, chunked prefill, every chunk size), and the demo model
// against the CPU forward pass over a sequence long enough to wrap the sliding window,
// fill compressed entries past the indexer's top-k and close windows mid-chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "testing.h"

namespace keel::cuda {
namespace {

// The checkout's files; scripts/gpu-check sets KEEL_SOURCE_DIR for a binary built in
// another checkout.
std::string source_path(const std::string& rel) {
  const char* root = std::getenv("KEEL_SOURCE_DIR");
  return std::string(root ? root : KEEL_SOURCE_DIR) + "/" + rel;
}

std::vector<int64_t> split_ints(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = text.find(',', at);
    out.push_back(std::stoll(text.substr(at, comma - at)));
    at = comma == std::string::npos ? text.size() : comma + 1;
  }
  return out;
}

// A fixture's transformers logits (tools/make_fixtures.py), batch row 0 and 1.
struct Reference {
  int64_t batch = 0, seq = 0, vocab = 0;
  std::vector<int32_t> ids;
  std::vector<float> full;
  std::vector<int64_t> prefills, chunks;

  explicit Reference(const std::string& dir) {
    const auto f = SafetensorsFile::open(dir + "/reference.safetensors");
    const TensorView id_view = f.view(*f.find("input_ids"));
    ids.assign(id_view.as<int32_t>(), id_view.as<int32_t>() + id_view.numel());
    batch = id_view.shape[0];
    seq = id_view.shape[1];
    const TensorView l = f.view(*f.find("logits_full"));
    full.assign(l.as<float>(), l.as<float>() + l.numel());
    vocab = static_cast<int64_t>(full.size()) / (batch * seq);
    prefills = split_ints(f.header().metadata.at("decode_prefill"));
    chunks = split_ints(f.header().metadata.at("chunks"));
  }
  std::span<const int32_t> row_ids(int64_t b) const { return std::span(ids).subspan(b * seq, seq); }
  std::span<const float> row_logits(int64_t b) const { return std::span(full).subspan(b * seq * vocab, seq * vocab); }
};

// Feeds `ids` through one device sequence in calls of the given sizes (the last repeats).
std::vector<float> run_in_calls(const GpuModel& model, std::span<const int32_t> ids, const std::vector<int64_t>& sizes) {
  DeviceSequence seq = model.new_sequence();
  std::vector<float> logits;
  size_t done = 0, call = 0;
  while (done < ids.size()) {
    const size_t n = std::min<size_t>(static_cast<size_t>(sizes[std::min(call, sizes.size() - 1)]), ids.size() - done);
    const auto out = model.forward(seq, ids.subspan(done, n));
    logits.insert(logits.end(), out.begin(), out.end());
    done += n;
    ++call;
  }
  EXPECT_EQ(seq.length, static_cast<int64_t>(ids.size()));
  return logits;
}

// Max |Δ| and the rows whose argmax differs.
void expect_close(std::span<const float> got, std::span<const float> want, int64_t vocab, float tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float max_abs = 0;
  for (size_t i = 0; i < want.size(); ++i) max_abs = std::max(max_abs, std::fabs(got[i] - want[i]));
  int mismatches = 0;
  for (size_t r = 0; r < want.size(); r += vocab) {
    const auto arg = [&](std::span<const float> l) {
      return std::max_element(l.begin() + r, l.begin() + r + vocab) - (l.begin() + r);
    };
    mismatches += arg(got) != arg(want);
  }
  EXPECT_LE(max_abs, tolerance) << what;
  EXPECT_EQ(mismatches, 0) << what;
}

struct Case {
  const char* dir;
  float tolerance;
};

class GpuParity : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (devices().empty()) GTEST_SKIP() << "no CUDA device";
    host_ = Model::load(source_path(std::string("tests/fixtures/") + GetParam().dir));
    gpu_ = GpuModel::create(*host_);
    ref_ = std::make_unique<Reference>(source_path(std::string("tests/fixtures/") + GetParam().dir));
  }
  void check(const std::vector<int64_t>& sizes, const std::string& what) {
    for (int64_t b = 0; b < ref_->batch; ++b) {
      expect_close(run_in_calls(*gpu_, ref_->row_ids(b), sizes), ref_->row_logits(b), ref_->vocab,
                   GetParam().tolerance, what + ", b" + std::to_string(b));
    }
  }
  std::unique_ptr<Model> host_;
  std::unique_ptr<GpuModel> gpu_;
  std::unique_ptr<Reference> ref_;
};

TEST_P(GpuParity, FullForward) { check({ref_->seq}, "full"); }

TEST_P(GpuParity, PrefillThenDecode) {
  for (int64_t p : ref_->prefills) check({p, 1}, "prefill " + std::to_string(p) + " then decode");
}

TEST_P(GpuParity, ChunkedPrefill) { check(ref_->chunks, "chunked"); }

TEST_P(GpuParity, EveryChunkSize) {
  for (int64_t size = 2; size <= ref_->seq; size += 3) check({size}, "chunks of " + std::to_string(size));
}

// The CPU forward pass meets these fixtures at 1e-4 (test_forward.cpp); the GPU sums
// in other orders (warp reductions, online softmax), which on these f32 models moves
// logits by a few 1e-6, so the same bound holds.
INSTANTIATE_TEST_SUITE_P(Fixtures, GpuParity,
                         ::testing::Values(Case{"tiny", 1e-4f}, Case{"flashlike_sigmoid", 1e-4f},
                                           Case{"tiny_quant", 1e-4f}));

// The demo model (FP8 dense, MXFP4 experts) over 300 random tokens: past the 64-token
// window, with 75 CSA entries against a top-k of 16, in uneven chunks, then decode.
TEST(GpuModel, DemoModelMatchesCpu) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  std::mt19937 rng(7);
  std::vector<int32_t> ids(300);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % host->config().vocab_size);
  Sequence cpu_seq = host->new_sequence();
  const std::vector<float> want = host->forward(cpu_seq, ids);
  const int64_t V = host->config().vocab_size;
  // bf16-scale tolerance relative to the logits' range: the CPU and GPU differ only in
  // summation order, but 6 layers of 256-wide f32 sums through softmax-pooled entries
  // and top-k picks leave ~1e-5 relative; 1e-3 of the largest |logit| bounds that with
  // margin and still catches any wrong key, entry or expert (those move logits by O(1)).
  float scale = 0;
  for (float v : want) scale = std::max(scale, std::fabs(v));
  expect_close(run_in_calls(*gpu, ids, {37, 1, 64, 5}), want, V, 1e-3f * scale, "chunks 37,1,64,5...");
  expect_close(run_in_calls(*gpu, ids, {200, 1}), want, V, 1e-3f * scale, "prefill 200 then decode");
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// GpuModel::blocks_needed bounds the blocks each forward takes from the state pool (the
// serving engine reserves it before a step), for first chunks, windows closing and
// decode steps. A copy shares every block, and it and the original then continue with
// the same bits as a sequence that ran the same chunks alone.
TEST(GpuModel, PagedStateBoundsGrowthAndCopiesShareBlocks) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  const DeviceBlockPool& pool = gpu->state_pool();
  std::mt19937 rng(11);
  std::vector<int32_t> ids(400);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % host->config().vocab_size);
  const auto run = [&](DeviceSequence& seq, size_t from, size_t n) {
    const int64_t before = pool.used(), bound = gpu->blocks_needed(seq, static_cast<int64_t>(n));
    auto logits = gpu->forward(seq, std::span(ids).subspan(from, n), LogitRows::last);
    EXPECT_LE(pool.used() - before, bound) << n << " tokens at " << from;
    return logits;
  };
  DeviceSequence seq = gpu->new_sequence(), alone = gpu->new_sequence();
  size_t at = 0;
  for (const size_t n : {1, 3, 64, 5, 128, 1, 1, 90}) {
    run(seq, at, n);
    run(alone, at, n);
    at += n;
  }
  const int64_t held = pool.used();
  DeviceSequence copy = gpu->clone(seq);
  EXPECT_EQ(pool.used(), held);
  EXPECT_EQ(copy.state_bytes(), seq.state_bytes());
  for (const size_t n : {1, 7, 1, 90}) {
    const auto want = run(alone, at, n), a = run(seq, at, n), b = run(copy, at, n);
    EXPECT_TRUE(same_bits(a, want)) << "the original after " << at;
    EXPECT_TRUE(same_bits(b, want)) << "the copy after " << at;
    at += n;
  }
}


// Batch invariance: sequences that join at different steps and run chunks of different
// sizes (prefill chunks beside decode tokens) in batched calls get exactly the logits,
// bit for bit, of the same calls made for each alone, and a batched call asking for
// each chunk's last row gets the single calls' last rows.
TEST(GpuModel, BatchedCallsEqualSingleCalls) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  const int64_t V = host->config().vocab_size;
  struct Schedule {
    int64_t length, join;
    std::vector<int64_t> sizes;  // chunk sizes, the last repeats
  };
  const std::vector<Schedule> plans{{260, 0, {37, 1, 64, 5, 1}}, {150, 2, {100, 1}}, {90, 1, {1}},
                                {40, 4, {13, 3, 1}},       {7, 5, {7, 1}}};
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> ids;
  for (const Schedule& p : plans) {
    ids.emplace_back(p.length);
    for (auto& id : ids.back()) id = static_cast<int32_t>(rng() % V);
  }
  std::vector<DeviceSequence> seqs;
  for (size_t i = 0; i < plans.size(); ++i) seqs.push_back(gpu->new_sequence());
  std::vector<std::vector<float>> batched(plans.size());
  std::vector<size_t> calls(plans.size());
  for (int64_t round = 0;; ++round) {
    std::vector<DeviceChunk> chunks;
    std::vector<size_t> who;
    for (size_t i = 0; i < plans.size(); ++i) {
      const int64_t done = seqs[i].length, left = plans[i].length - done;
      if (round < plans[i].join || left == 0) continue;
      const auto& sizes = plans[i].sizes;
      const int64_t n = std::min(sizes[std::min(calls[i]++, sizes.size() - 1)], left);
      chunks.push_back({&seqs[i], std::span(ids[i]).subspan(done, n)});
      who.push_back(i);
    }
    if (chunks.empty()) break;
    const auto logits = gpu->forward(chunks);
    for (size_t j = 0; j < who.size(); ++j) {
      ASSERT_EQ(logits[j].size(), chunks[j].tokens.size() * V);
      batched[who[j]].insert(batched[who[j]].end(), logits[j].begin(), logits[j].end());
    }
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    EXPECT_EQ(seqs[i].length, plans[i].length);
    EXPECT_TRUE(same_bits(batched[i], run_in_calls(*gpu, ids[i], plans[i].sizes))) << "sequence " << i;
  }
  // One more token each, last rows only: batched against each sequence's copy alone.
  std::vector<DeviceSequence> copies;
  std::vector<DeviceChunk> chunks;
  const std::vector<int32_t> next{5, 17, 2, 40, 9};
  for (size_t i = 0; i < seqs.size(); ++i) copies.push_back(gpu->clone(seqs[i]));
  for (size_t i = 0; i < seqs.size(); ++i) chunks.push_back({&seqs[i], std::span(&next[i], 1)});
  const auto last = gpu->forward(chunks, LogitRows::last);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_TRUE(same_bits(last[i], gpu->forward(copies[i], std::span(&next[i], 1), LogitRows::last))) << i;
  }
}

// The engine's call: each chunk's last row summarized on the device gives exactly what
// the same rows copied back and summarized by ops/sampling.h give (candidates, order,
// whole-row pick, chosen token); a chunk without a choice runs with no logits at all.
TEST(GpuModel, ChoicesAreTheLastRowsSummarizedOnTheHost) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  const int64_t V = host->config().vocab_size;
  std::mt19937 rng(5);
  const std::vector<int64_t> lengths{9, 1, 33, 4};
  std::vector<std::vector<int32_t>> ids;
  for (const int64_t n : lengths) {
    ids.emplace_back(n);
    for (auto& id : ids.back()) id = static_cast<int32_t>(rng() % V);
  }
  const std::vector<std::optional<RowChoice>> choices{
      RowChoice{{.temperature = 0.0f}, 0, 5},
      RowChoice{{.temperature = 0.9f, .seed = 3}, 4, 1},
      std::nullopt,
      RowChoice{{.temperature = 1.1f, .top_k = 20, .top_p = 0.8f, .seed = 8}, 2, 3},
  };
  std::vector<DeviceSequence> seqs, copies;
  std::vector<DeviceChunk> chunks, copy_chunks;
  for (size_t i = 0; i < lengths.size(); ++i) {
    seqs.push_back(gpu->new_sequence());
    copies.push_back(gpu->new_sequence());
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    chunks.push_back({&seqs[i], ids[i]});
    copy_chunks.push_back({&copies[i], ids[i]});
  }
  const auto got = gpu->forward(chunks, choices);
  const auto logits = gpu->forward(copy_chunks, LogitRows::last);
  ASSERT_EQ(got.size(), choices.size());
  for (size_t i = 0; i < choices.size(); ++i) {
    EXPECT_EQ(seqs[i].length, lengths[i]);
    if (!choices[i]) {
      EXPECT_FALSE(got[i].has_value()) << i;
      continue;
    }
    ASSERT_TRUE(got[i].has_value()) << i;
    const RowSummary want = summarize_for(logits[i], *choices[i]);
    EXPECT_EQ(got[i]->ids, want.ids) << i;
    EXPECT_EQ(got[i]->logits, want.logits) << i;
    EXPECT_EQ(got[i]->whole_pick, want.whole_pick) << i;
    EXPECT_NEAR(got[i]->log_z, want.log_z, 1e-5f * std::max(1.0f, std::fabs(want.log_z))) << i;
    EXPECT_EQ(choose(choices[i]->params, choices[i]->draw, *got[i]), choose(choices[i]->params, choices[i]->draw, want))
        << i;
  }
  // The sequence that ran without logits is where its copy is: the next token agrees.
  const int32_t next = 7;
  EXPECT_TRUE(same_bits(gpu->forward(seqs[2], std::span(&next, 1)), gpu->forward(copies[2], std::span(&next, 1))));
}

// A batch with a bad chunk, or one sequence twice, fails before any sequence changes.
TEST(GpuModel, BatchedCallRejectsBadChunksFirst) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("tests/fixtures/tiny"));
  const auto gpu = GpuModel::create(*host);
  DeviceSequence a = gpu->new_sequence(), b = gpu->new_sequence();
  const std::vector<int32_t> good{1, 2, 3}, bad{1, 97};
  const std::vector<DeviceChunk> with_bad{{&a, good}, {&b, bad}}, twice{{&a, good}, {&a, good}};
  EXPECT_THROW(gpu->forward(with_bad), Error);
  EXPECT_THROW(gpu->forward(twice), Error);
  EXPECT_EQ(a.length, 0);
  EXPECT_EQ(b.length, 0);
}

TEST(GpuModel, RejectsBadInputAndKeepsTheSequence) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("tests/fixtures/tiny"));
  const auto gpu = GpuModel::create(*host);
  DeviceSequence seq = gpu->new_sequence();
  const std::vector<int32_t> bad{1, 97};
  EXPECT_THROW(gpu->forward(seq, bad), Error);
  EXPECT_EQ(seq.length, 0);
}

// The demo model on the GPU twice: with decode graphs (the default) and without.
struct GraphsAndEager {
  std::unique_ptr<Model> host = Model::load(source_path("models/keel-tiny-v4"));
  std::unique_ptr<GpuModel> graphs = GpuModel::create(*host), eager = GpuModel::create(*host);
  GraphsAndEager() { eager->set_decode_graphs(false); }
};

// Decode steps run as CUDA graphs (their pieces made or updated) give, bit for bit, what
// the same steps launched kernel by kernel give. The steps pad to every bucket up to 24 rows, in an order where a
// larger bucket regrows the buffers between captures; some sequences start with a decode
// step (one token of context: no ring, no compressed entries, an empty indexer
// selection); prompt chunks in some steps make those steps run launch by launch between
// replays; the sequences grow past the sliding window and the indexer's top-k, closing
// compressor windows on the way.
TEST(GpuModel, DecodeGraphsGiveTheLaunchedBits) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const GraphsAndEager models;
  const auto& [host, graphs, eager] = models;
  const int64_t V = host->config().vocab_size;
  std::mt19937 rng(23);
  const std::vector<int> widths{1, 1, 2, 3, 1, 5, 2, 8, 3, 17, 1, 4, 20, 2, 6, 9, 1, 24, 3, 1};
  constexpr int kSequences = 24;
  std::vector<DeviceSequence> with, without;
  for (int i = 0; i < kSequences; ++i) {
    with.push_back(graphs->new_sequence());
    without.push_back(eager->new_sequence());
  }
  int64_t step = 0, decode_steps = 0;
  for (int round = 0; round < 6; ++round) {
    for (const int width : widths) {
      std::vector<std::vector<int32_t>> ids(width);
      std::vector<DeviceChunk> a, b;
      for (int j = 0; j < width; ++j) {
        const int i = static_cast<int>((step + j) % kSequences);
        // Every fifth step, its first chunk is a prompt of 30 to 70 tokens.
        ids[j].resize(j == 0 && step % 5 == 4 ? 30 + rng() % 41 : 1);
        for (auto& id : ids[j]) id = static_cast<int32_t>(rng() % V);
        a.push_back({&with[i], ids[j]});
        b.push_back({&without[i], ids[j]});
      }
      decode_steps += step % 5 != 4;
      const auto got = graphs->forward(a), want = eager->forward(b);
      for (int j = 0; j < width; ++j) {
        ASSERT_EQ(got[j].size(), ids[j].size() * V);
        ASSERT_TRUE(same_bits(got[j], want[j])) << "step " << step << ", chunk " << j << " of " << width;
      }
      ++step;
    }
  }
  for (int i = 0; i < kSequences; ++i) EXPECT_EQ(with[i].length, without[i].length);
  EXPECT_GT(with[0].length, host->config().sliding_window + 16);
  const DecodeGraphCounts counts = graphs->decode_graph_counts();
  EXPECT_EQ(counts.failure, "");
  // A bucket's pieces are made again after every regrowth that precedes its next step,
  // and for each new shape (windows closing); most other decode steps update them.
  EXPECT_GT(counts.captured, 6);
  EXPECT_GT(counts.replayed, decode_steps / 2);
  EXPECT_EQ(eager->decode_graph_counts().replayed, 0);
}

// Graphs off and on again mid-way: the steps keep their bits, and a sequence's steps
// through the choices path (the engine's) pick what the launched steps pick.
TEST(GpuModel, DecodeGraphsTurnOffAndOn) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const GraphsAndEager models;
  const auto& [host, graphs, eager] = models;
  std::vector<DeviceSequence> with, without;
  for (int i = 0; i < 3; ++i) {
    with.push_back(graphs->new_sequence());
    without.push_back(eager->new_sequence());
  }
  std::vector<int32_t> next{3, 99, 1000};
  for (int step = 0; step < 40; ++step) {
    const std::vector<std::optional<RowChoice>> choices(
        3, RowChoice{{.temperature = 0.8f, .seed = 4}, static_cast<uint64_t>(step), 5});
    if (step == 10) graphs->set_decode_graphs(false);
    if (step == 20) graphs->set_decode_graphs(true);
    std::vector<DeviceChunk> a, b;
    for (int i = 0; i < 3; ++i) {
      a.push_back({&with[i], std::span(&next[i], 1)});
      b.push_back({&without[i], std::span(&next[i], 1)});
    }
    const auto got = graphs->forward(a, choices), want = eager->forward(b, choices);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(got[i] && want[i]);
      ASSERT_EQ(got[i]->ids, want[i]->ids) << "step " << step;
      ASSERT_EQ(got[i]->logits, want[i]->logits) << "step " << step;
      ASSERT_EQ(got[i]->whole_pick, want[i]->whole_pick) << "step " << step;
      next[i] = choose(choices[i]->params, choices[i]->draw, *got[i]);
    }
  }
  EXPECT_GT(graphs->decode_graph_counts().replayed, 10);
  EXPECT_EQ(graphs->decode_graph_counts().failure, "");
}

using keel::testing::same_summary;

// Pipelined steps (begin, finish a step late; tokens picked on the device) give the
// summaries, bit for bit, of the same steps waited for one by one (forward with choices).
// Five sequences (a bucket of 8, padded) of the demo model, whose first two layers route
// by hash (the picked tokens' experts are looked up on the device): greedy rows, a
// whole-row sampling row, and a row that draws with top-k and top-p every fifth step,
// after which the host gives its token (taken from the waited run: the host chooses it)
// and the call is finished before the next begins. Graphs off for a stretch in the
// middle (every call finished first).
TEST(GpuModel, PipelinedStepsGiveTheWaitedBits) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  ASSERT_EQ(host->config().mlp.front(), MlpKind::hash_moe);
  const auto gpu = GpuModel::create(*host);
  const int64_t V = host->config().vocab_size;
  constexpr int kSequences = 5, kSteps = 40;
  const auto choice = [](int i, int step) -> RowChoice {
    const auto draw = static_cast<uint64_t>(step);
    switch (i) {
      case 2: return {{.temperature = 0.9f, .seed = 12}, draw, 1};
      case 4:
        if (step % 5 == 0) return {{.temperature = 1.1f, .top_k = 40, .top_p = 0.9f, .seed = 3}, draw, 1};
        [[fallthrough]];
      default: return {{.temperature = 0.0f}, 0, i + 1};
    }
  };
  const auto expect_step = [&](const std::vector<std::optional<RowSummary>>& got, const auto& want, int step) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i] && same_summary(*got[i], *want[i])) << "step " << step << ", sequence " << i;
    }
  };
  std::mt19937 rng(31);
  std::vector<std::vector<int32_t>> prompts(kSequences);
  for (int i = 0; i < kSequences; ++i) {
    prompts[i].resize(3 + 11 * i);
    for (auto& id : prompts[i]) id = static_cast<int32_t>(rng() % V);
  }
  // Each run: its sequences after their prompts, and the prompts' tokens chosen.
  const auto start = [&](std::vector<DeviceSequence>& seqs) {
    std::vector<DeviceChunk> chunks;
    std::vector<std::optional<RowChoice>> choices;
    for (int i = 0; i < kSequences; ++i) seqs.push_back(gpu->new_sequence());
    for (int i = 0; i < kSequences; ++i) {
      chunks.push_back({&seqs[i], prompts[i]});
      choices.push_back(choice(i, 0));
    }
    std::vector<int32_t> next;
    const auto rows = gpu->forward(chunks, choices);
    for (int i = 0; i < kSequences; ++i) next.push_back(choose(choices[i]->params, choices[i]->draw, *rows[i]));
    return next;
  };

  std::vector<DeviceSequence> waited_seqs;
  std::vector<std::vector<int32_t>> tokens{start(waited_seqs)};  // tokens[s]: what step s runs
  std::vector<std::vector<std::optional<RowSummary>>> waited;
  for (int step = 1; step <= kSteps; ++step) {
    if (step == 15) gpu->set_decode_graphs(false);
    if (step == 22) gpu->set_decode_graphs(true);
    std::vector<DeviceChunk> chunks;
    std::vector<std::optional<RowChoice>> choices;
    for (int i = 0; i < kSequences; ++i) {
      chunks.push_back({&waited_seqs[i], std::span(&tokens.back()[i], 1)});
      choices.push_back(choice(i, step));
    }
    waited.push_back(gpu->forward(chunks, choices));
    std::vector<int32_t> next;
    for (int i = 0; i < kSequences; ++i) next.push_back(choose(choices[i]->params, choices[i]->draw, *waited.back()[i]));
    tokens.push_back(next);
  }

  std::vector<DeviceSequence> seqs;
  ASSERT_EQ(start(seqs), tokens.front());
  for (int step = 1; step <= kSteps; ++step) {
    if (step == 15 || step == 22) {  // every call finished first, as switching graphs needs
      EXPECT_THROW(gpu->set_decode_graphs(step == 22), Error);
      expect_step(gpu->finish(), waited[step - 2], step - 1);
      gpu->set_decode_graphs(step == 22);
    }
    std::vector<DeviceChunk> chunks;
    std::vector<std::optional<RowChoice>> choices;
    const bool before = step > 1 && step != 15 && step != 22;  // a begun call to pick from
    for (int i = 0; i < kSequences; ++i) {
      const bool picked = before && pick_kind(choice(i, step - 1).params) != PickKind::candidates;
      chunks.push_back(picked ? DeviceChunk{&seqs[i], {}, i} : DeviceChunk{&seqs[i], std::span(&tokens[step - 1][i], 1)});
      choices.push_back(choice(i, step));
    }
    gpu->begin(chunks, choices);
    if (before) expect_step(gpu->finish(), waited[step - 2], step - 1);
  }
  expect_step(gpu->finish(), waited.back(), kSteps);
  for (int i = 0; i < kSequences; ++i) EXPECT_EQ(seqs[i].length, waited_seqs[i].length);
  // Counted since graphs turned on again at step 22: every step from there ran as a graph,
  // made for its shape or updated to it.
  const DecodeGraphCounts counts = gpu->decode_graph_counts();
  EXPECT_EQ(counts.captured + counts.replayed, kSteps - 21);
  EXPECT_GT(counts.replayed, 10);
  EXPECT_EQ(gpu->decode_graph_counts().failure, "");
}

// What begin refuses, before any sequence changes: a pick with no call begun before, a
// pick of a chunk whose draw the host makes or that had no choice, a chunk with both
// tokens and a pick, a third call begun; and the other calls while one is begun.
TEST(GpuModel, PipelinedStepsRefuseWhatCannotBePicked) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("tests/fixtures/tiny"));
  const auto gpu = GpuModel::create(*host);
  DeviceSequence a = gpu->new_sequence(), b = gpu->new_sequence(), c = gpu->new_sequence();
  const std::vector<int32_t> prompt{1, 2, 3};
  const std::optional<RowChoice> greedy = RowChoice{}, top_k = RowChoice{{.temperature = 1.0f, .top_k = 5}, 0, 1};
  const std::vector<DeviceChunk> picks_nothing{{&a, {}, 0}};
  EXPECT_THROW(gpu->begin(picks_nothing, std::vector{greedy}), Error);
  EXPECT_EQ(a.length, 0);
  const std::vector<DeviceChunk> prompts{{&a, prompt}, {&b, prompt}, {&c, prompt}};
  gpu->begin(prompts, std::vector{greedy, top_k, std::optional<RowChoice>{}});
  EXPECT_THROW(gpu->forward(a, prompt), Error);
  EXPECT_THROW(gpu->forward(prompts, std::vector{greedy, greedy, greedy}), Error);
  const int32_t token = 5;
  for (const DeviceChunk& bad : {DeviceChunk{&b, {}, 1}, DeviceChunk{&b, {}, 2}, DeviceChunk{&b, {}, 3},
                                 DeviceChunk{&b, std::span(&token, 1), 0}}) {
    const std::vector<DeviceChunk> chunks{{&a, {}, 0}, bad};
    EXPECT_THROW(gpu->begin(chunks, std::vector{greedy, greedy}), Error);
  }
  EXPECT_EQ(a.length, 3);
  EXPECT_EQ(b.length, 3);
  const std::vector<DeviceChunk> step{{&a, {}, 0}, {&b, std::span(&token, 1)}};
  gpu->begin(step, std::vector{greedy, greedy});
  EXPECT_THROW(gpu->begin(step, std::vector{greedy, greedy}), Error);
  EXPECT_EQ(gpu->finish().size(), 3u);
  EXPECT_EQ(gpu->finish().size(), 2u);
  EXPECT_THROW(gpu->finish(), Error);
  EXPECT_EQ(a.length, 4);
  EXPECT_EQ(b.length, 4);
}

}  // namespace
}  // namespace keel::cuda
