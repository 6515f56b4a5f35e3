// The CPU forward pass against transformers 5.17.0 (tests/fixtures, made by
// tools/make_fixtures.py): full forward, prefill + token-by-token decode, and chunked
// prefill, all compared with transformers' full-forward logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>

#include "io/safetensors.h"
#include "model/model.h"
#include "model/perplexity.h"
#include "testing.h"

namespace keel {
namespace {

std::string fixture(const std::string& name) { return std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/" + name; }

std::vector<int64_t> split_ints(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  return out;
}

// reference.safetensors of one fixture.
struct Reference {
  int64_t batch = 0, seq = 0, vocab = 0;
  std::vector<int32_t> ids;     // [batch, seq]
  std::vector<float> full;      // [batch, seq, vocab]
  std::vector<float> chunked;   // [batch, seq, vocab]
  std::vector<int64_t> prefills, chunks;

  explicit Reference(const std::string& dir) {
    const auto f = SafetensorsFile::open(dir + "/reference.safetensors");
    const auto floats = [&](const char* name) {
      const TensorView v = f.view(*f.find(name));
      return std::vector<float>(v.as<float>(), v.as<float>() + v.numel());
    };
    const TensorView id_view = f.view(*f.find("input_ids"));
    ids.assign(id_view.as<int32_t>(), id_view.as<int32_t>() + id_view.numel());
    batch = id_view.shape[0];
    seq = id_view.shape[1];
    full = floats("logits_full");
    chunked = floats("logits_chunked");
    vocab = static_cast<int64_t>(full.size()) / (batch * seq);
    prefills = split_ints(f.header().metadata.at("decode_prefill"));
    chunks = split_ints(f.header().metadata.at("chunks"));
  }
  std::span<const int32_t> row_ids(int64_t b) const { return std::span(ids).subspan(b * seq, seq); }
  std::span<const float> row_logits(const std::vector<float>& l, int64_t b) const {
    return std::span(l).subspan(b * seq * vocab, seq * vocab);
  }
};

// Max |Δ| over [seq, vocab] logits, and positions whose argmax differs.
struct Comparison {
  float max_abs = 0;
  int argmax_mismatches = 0;
  float max_abs_logit = 0;
};

Comparison compare(std::span<const float> got, std::span<const float> want, int64_t vocab) {
  Comparison c;
  for (size_t i = 0; i < want.size(); ++i) {
    c.max_abs = std::max(c.max_abs, std::fabs(got[i] - want[i]));
    c.max_abs_logit = std::max(c.max_abs_logit, std::fabs(want[i]));
  }
  for (size_t r = 0; r < want.size(); r += vocab) {
    const auto arg = [&](std::span<const float> l) {
      return std::max_element(l.begin() + r, l.begin() + r + vocab) - (l.begin() + r);
    };
    c.argmax_mismatches += arg(got) != arg(want);
  }
  return c;
}

// Feeds `ids` through one sequence in calls of the given sizes (the last repeats).
std::vector<float> run_in_calls(const Model& model, std::span<const int32_t> ids, const std::vector<int64_t>& sizes) {
  Sequence seq = model.new_sequence();
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

struct Case {
  const char* dir;
  float tolerance;  // max |Δlogit|
};

class Parity : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    model_ = Model::load(fixture(GetParam().dir));
    ref_ = std::make_unique<Reference>(fixture(reference_dir()));
  }
  // transformers-named copies share their parent's reference.
  std::string reference_dir() const {
    std::string d = GetParam().dir;
    const auto slash = d.find('/');
    return slash == std::string::npos ? d : d.substr(0, slash);
  }
  void expect_close(const std::vector<float>& got, int64_t b, const std::string& what) {
    ASSERT_EQ(static_cast<int64_t>(got.size()), ref_->seq * ref_->vocab) << what;
    const Comparison c = compare(got, ref_->row_logits(ref_->full, b), ref_->vocab);
    EXPECT_LE(c.max_abs, GetParam().tolerance) << what << " (max |logit| " << c.max_abs_logit << ")";
    EXPECT_EQ(c.argmax_mismatches, 0) << what;
    RecordProperty(what, std::to_string(c.max_abs));
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<Reference> ref_;
};

TEST_P(Parity, FullForward) {
  for (int64_t b = 0; b < ref_->batch; ++b) {
    expect_close(run_in_calls(*model_, ref_->row_ids(b), {ref_->seq}), b, "full b" + std::to_string(b));
  }
}

TEST_P(Parity, PrefillThenDecode) {
  for (int64_t p : ref_->prefills) {
    for (int64_t b = 0; b < ref_->batch; ++b) {
      expect_close(run_in_calls(*model_, ref_->row_ids(b), {p, 1}), b,
                   "prefill " + std::to_string(p) + " then decode, b" + std::to_string(b));
    }
  }
}

TEST_P(Parity, ChunkedPrefill) {
  for (int64_t b = 0; b < ref_->batch; ++b) {
    expect_close(run_in_calls(*model_, ref_->row_ids(b), ref_->chunks), b, "chunked b" + std::to_string(b));
  }
}

TEST_P(Parity, EveryChunkSize) {
  for (int64_t size = 2; size <= ref_->seq; size += 3) {
    expect_close(run_in_calls(*model_, ref_->row_ids(0), {size}), 0, "chunks of " + std::to_string(size));
  }
}

// The engine's own chunked logits agree with transformers' chunked run as well.
TEST_P(Parity, MatchesTransformersChunkedRun) {
  const auto got = run_in_calls(*model_, ref_->row_ids(1), ref_->chunks);
  const Comparison c = compare(got, ref_->row_logits(ref_->chunked, 1), ref_->vocab);
  EXPECT_LE(c.max_abs, GetParam().tolerance);
}

// fp32 fixtures: 1e-4 (the bound); transformers' own decode differs from its
// full forward by up to 5e-6. tiny_quant runs on the packed FP8/MXFP4 bytes against
// transformers on the dequantized weights, so it is held to the same bound.
INSTANTIATE_TEST_SUITE_P(All, Parity,
                         ::testing::Values(Case{"tiny", 1e-4f}, Case{"flashlike_sigmoid", 1e-4f},
                                           Case{"flashlike_sigmoid/transformers", 1e-4f},
                                           Case{"tiny_quant", 1e-4f}),
                         [](const auto& info) {
                           std::string n = info.param.dir;
                           std::replace(n.begin(), n.end(), '/', '_');
                           return n;
                         });

TEST(Forward, RejectsBadInput) {
  const auto model = Model::load(fixture("tiny"));
  Sequence seq = model->new_sequence();
  const std::vector<int32_t> too_big{1, 97}, negative{-1}, empty{};
  EXPECT_NE(KEEL_EXPECT_ERROR(model->forward(seq, too_big), ErrorCode::bad_input).find("97"), std::string::npos);
  KEEL_EXPECT_ERROR(model->forward(seq, negative), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(model->forward(seq, empty), ErrorCode::bad_input);
  EXPECT_EQ(seq.length, 0);  // nothing was appended
  const std::vector<int32_t> long_prompt(static_cast<size_t>(model->config().max_position_embeddings) + 1, 3);
  EXPECT_NE(KEEL_EXPECT_ERROR(model->forward(seq, long_prompt), ErrorCode::bad_input).find("max_position"),
            std::string::npos);
}

// Several sequences in one call: each chunk's logits (none, the last row or every row)
// bit for bit those of the same chunk run alone on a twin of its sequence, over steps that mix prompt
// chunks of every path (1 to 9 tokens) with decode rows, past the sliding window and
// across window closings; chunks without head rows; then the bad calls, which change
// no sequence.
TEST(Forward, BatchedChunksGiveTheBitsOfSeparateCalls) {
  const auto model = Model::load(fixture("tiny_quant"));
  const int64_t V = model->config().vocab_size;
  std::mt19937 rng(5);
  const auto ids = [&](int64_t n) {
    std::vector<int32_t> t(n);
    for (auto& id : t) id = static_cast<int32_t>(rng() % V);
    return t;
  };
  constexpr int kSequences = 5;
  std::vector<Sequence> batched(kSequences, model->new_sequence()), alone(kSequences, model->new_sequence());
  const std::vector<std::vector<int64_t>> steps{{3, 9, 1, 5, 4}, {1, 1, 6, 1, 2}, {7, 1, 1, 1, 1}, {1, 8, 1, 3, 1}};
  for (int round = 0; round < 3; ++round) {
    for (const auto& sizes : steps) {
      std::vector<std::vector<int32_t>> tokens;
      std::vector<Model::Chunk> chunks;
      std::vector<int64_t> heads;
      for (int i = 0; i < kSequences; ++i) {
        tokens.push_back(ids(sizes[i]));
        heads.push_back((i + round) % 3 == 0 ? 0 : (i % 2 ? 1 : sizes[i]));
      }
      for (int i = 0; i < kSequences; ++i) chunks.push_back({&batched[i], tokens[i]});
      const auto got = model->forward(chunks, heads);
      ASSERT_EQ(got.size(), static_cast<size_t>(kSequences));
      for (int i = 0; i < kSequences; ++i) {
        // Alone with the same head rows: the last one, or all (a head of several rows
        // takes another path than a head of one).
        const std::vector<float> rows =
            model->forward(alone[i], tokens[i], heads[i] == sizes[i] ? LogitRows::all : LogitRows::last);
        const std::vector<float> want = heads[i] ? rows : std::vector<float>{};
        ASSERT_EQ(got[i].size(), want.size()) << "sequence " << i;
        ASSERT_EQ(std::memcmp(got[i].data(), want.data(), want.size() * sizeof(float)), 0)
            << "round " << round << ", sequence " << i << ", " << sizes[i] << " tokens";
        ASSERT_EQ(batched[i].length, alone[i].length);
      }
    }
  }
  // A bad token in one chunk, or a sequence twice: an error, and no sequence changed.
  const int64_t before = batched[0].length;
  const std::vector<int32_t> good{1, 2}, bad{3, static_cast<int32_t>(V)};
  const std::vector<Model::Chunk> with_bad{{&batched[0], good}, {&batched[1], bad}};
  const std::vector<int64_t> ones{1, 1};
  KEEL_EXPECT_ERROR(model->forward(with_bad, ones), ErrorCode::bad_input);
  const std::vector<Model::Chunk> twice{{&batched[0], good}, {&batched[0], good}};
  KEEL_EXPECT_ERROR(model->forward(twice, ones), ErrorCode::usage);
  EXPECT_EQ(batched[0].length, before);
}

// The state grows with the tokens processed, by the amounts of dsv4-forward.md §7.1.
TEST(Forward, StateGrowsWithTokensNotContext) {
  const auto model = Model::load(fixture("tiny"));
  const ModelConfig& c = model->config();
  Sequence seq = model->new_sequence();
  const Reference ref(fixture("tiny"));
  model->forward(seq, ref.row_ids(0));  // 45 tokens
  const LayerState& csa = seq.layers[1];
  const LayerState& hca = seq.layers[2];
  EXPECT_EQ(csa.compressor.count, 45 / 4);
  EXPECT_EQ(csa.indexer.count, 45 / 4);
  EXPECT_EQ(csa.compressor.pending, 45 % 4);
  EXPECT_EQ(csa.compressor.carry_kv.size(), 4);
  EXPECT_EQ(csa.compressor.carry_kv.width(), c.head_dim);
  EXPECT_EQ(csa.indexer.carry_kv.size(), 4);
  EXPECT_EQ(csa.indexer.carry_kv.width(), c.index_head_dim);
  EXPECT_EQ(hca.compressor.count, 45 / 8);
  EXPECT_EQ(hca.compressor.pending, 45 % 8);
  EXPECT_TRUE(hca.compressor.carry_kv.empty());
  EXPECT_TRUE(hca.indexer.entries.empty());
  EXPECT_EQ(seq.layers[0].window.size(), c.sliding_window);
  EXPECT_LT(seq.state_bytes(), uint64_t(64) << 10);  // nothing sized by max_position (256)
}

// Bytes of the rows a sequence's arrays hold (not the blocks around them), and how many
// arrays hold any.
std::pair<uint64_t, int> row_bytes(const Sequence& s) {
  uint64_t bytes = 0;
  int arrays = 0;
  for (const auto* group : {&s.layers, &s.draft}) {
    for (const LayerState& l : *group) {
      std::vector<const PagedRows*> all{&l.window};
      for (const CompressorState* c : {&l.compressor, &l.indexer}) {
        for (const PagedRows* r : {&c->entries, &c->pending_kv, &c->pending_gate, &c->carry_kv, &c->carry_gate}) all.push_back(r);
      }
      for (const PagedRows* r : all) {
        bytes += static_cast<uint64_t>(r->size() * r->width()) * sizeof(float);
        arrays += !r->empty();
      }
    }
  }
  return {bytes, arrays};
}

// The state a token adds is what Model::state_bytes_per_token says (between lengths that
// leave no window open, so only entries and indexer keys differ), and what a sequence
// holds besides stays within state_bytes_per_sequence; the blocks around the rows add
// less than one block per array.
TEST(Forward, StateBytesPerTokenMatchTheGrowth) {
  const auto model = Model::load(fixture("tiny"));
  const int64_t V = model->config().vocab_size;
  std::vector<int32_t> ids(128);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 5) % V);
  Sequence seq = model->new_sequence();
  model->forward(seq, std::span(ids).subspan(0, 64));  // a multiple of both ratios (4, 8)
  const uint64_t at64 = row_bytes(seq).first;
  model->forward(seq, std::span(ids).subspan(64, 64));
  const auto [at128, arrays] = row_bytes(seq);
  EXPECT_EQ(static_cast<double>(at128 - at64), 64 * model->state_bytes_per_token());
  EXPECT_GT(model->state_bytes_per_token(), 0);
  EXPECT_LE(static_cast<double>(at128), model->state_bytes_per_sequence() + 128 * model->state_bytes_per_token());
  EXPECT_GE(seq.state_bytes(), at128);
  EXPECT_LT(seq.state_bytes(), at128 + arrays * model->state_block_floats() * sizeof(float));
}

// A copy of a sequence shares its blocks: copying takes none, and each side's writes go
// to blocks of its own, so both continue exactly (the same bits) as a sequence that ran
// the same chunks alone. Every forward takes at most Model::blocks_needed blocks from the pool, with
// and without a copy sharing them.
TEST(Forward, CopiesShareStateBlocksUntilWritten) {
  const auto model = Model::load(fixture("tiny"));
  const int64_t V = model->config().vocab_size;
  std::vector<int32_t> ids(80);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 53 + 11) % V);
  auto pool = std::make_shared<HostBlockPool>(model->state_block_floats());
  const auto run = [&](Sequence& s, int64_t from, int64_t n) {
    const int64_t bound = model->blocks_needed(s, n), before = pool->used();
    auto logits = model->forward(s, std::span(ids).subspan(from, n));
    EXPECT_LE(pool->used() - before, bound) << n << " tokens from " << from;
    return logits;
  };
  const std::vector<std::pair<int64_t, int64_t>> prefix{{0, 1}, {1, 13}, {14, 30}, {44, 1}},  // 45 tokens
      rest{{45, 1}, {46, 3}, {49, 31}};
  Sequence a = model->new_sequence(pool), alone = model->new_sequence(pool);
  for (const auto& [from, n] : prefix) {
    run(a, from, n);
    run(alone, from, n);
  }
  const int64_t held = pool->used();
  Sequence b = a;
  EXPECT_EQ(pool->used(), held);
  for (const auto& [from, n] : rest) {
    const auto expected = run(alone, from, n), from_a = run(a, from, n), from_b = run(b, from, n);
    EXPECT_EQ(0, std::memcmp(from_a.data(), expected.data(), expected.size() * sizeof(float))) << from;
    EXPECT_EQ(0, std::memcmp(from_b.data(), expected.data(), expected.size() * sizeof(float))) << from;
  }
}

// A pool at capacity fails the forward with out_of_memory, naming the budget.
TEST(Forward, FullStatePoolFailsClearly) {
  const auto model = Model::load(fixture("tiny"));
  auto pool = std::make_shared<HostBlockPool>(model->state_block_floats(), 2);
  Sequence s = model->new_sequence(pool);
  const std::vector<int32_t> ids{1, 2, 3};
  KEEL_EXPECT_ERROR(model->forward(s, ids), ErrorCode::out_of_memory);
}

// Perplexity over windows equals the one computed from transformers' logits of each
// window (a window is a fresh sequence, so row 0's first 20 and next 20 tokens).
TEST(Forward, PerplexityMatchesTransformersLogits) {
  const auto model = Model::load(fixture("tiny"));
  const Reference ref(fixture("tiny"));
  const auto ids = ref.row_ids(0);
  const PerplexityResult whole = perplexity(*model, ids, ref.seq);
  double nll = 0;
  for (int64_t t = 0; t + 1 < ref.seq; ++t) {
    const float* row = &ref.full[t * ref.vocab];
    double sum = 0;
    for (int64_t v = 0; v < ref.vocab; ++v) sum += std::exp(double(row[v]));
    nll += std::log(sum) - row[ids[t + 1]];
  }
  EXPECT_EQ(whole.predicted, ref.seq - 1);
  EXPECT_EQ(whole.windows, 1);
  EXPECT_NEAR(whole.nats_per_token(), nll / (ref.seq - 1), 1e-5);
  EXPECT_NEAR(whole.perplexity(), std::exp(nll / (ref.seq - 1)), 1e-4);
  // Windows of 20: 45 tokens -> windows of 20, 20, 5 with 19 + 19 + 4 predictions.
  const PerplexityResult windows = perplexity(*model, ids, 20);
  EXPECT_EQ(windows.windows, 3);
  EXPECT_EQ(windows.predicted, 42);
  KEEL_EXPECT_ERROR(perplexity(*model, ids.subspan(0, 1), 20), ErrorCode::bad_input);
}

}  // namespace
}  // namespace keel
