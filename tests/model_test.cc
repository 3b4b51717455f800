// Tests of the reference llama2.c runner and the synthetic KV generator.
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "models/cpu_affinity.h"
#include "models/llama2.h"
#include "models/synthetic_kv.h"

namespace km = kvxfer::model;

namespace {

const char* kModelPath = KVXFER_DATA_DIR "/stories260K.bin";

const std::vector<int> kReference = {461, 461, 401, 401, 401, 461, 378, 455, 473, 456,
                                     435, 299, 362, 409, 283, 264, 283, 452, 288, 13};

// Loaded once for the whole binary; nullptr (with the message) if missing.
const km::Model* model(std::string* why) {
  static std::string error;
  static std::unique_ptr<km::Model> m = km::Model::load(kModelPath, &error);
  if (!m && why != nullptr) *why = error;
  return m.get();
}

#define REQUIRE_MODEL(m)                                                                      \
  std::string load_error_;                                                                    \
  const km::Model* m = model(&load_error_);                                                   \
  ASSERT_NE(m, nullptr) << "cannot load the test model " << kModelPath << ": " << load_error_ \
                        << " (the reference checkpoint must be present; not skipping)"

int argmax(const std::vector<float>& v, std::size_t row = 0, std::size_t n = 0) {
  if (n == 0) n = v.size();
  return km::argmax(v.data() + row * n, n);
}

// max |a-b| / max(1, max|a|).
double rel_diff(const float* a, const float* b, std::size_t n) {
  double md = 0.0, ma = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    md = std::max(md, std::fabs(static_cast<double>(a[i]) - b[i]));
    ma = std::max(ma, std::fabs(static_cast<double>(a[i])));
  }
  return md / std::max(1.0, ma);
}

// Greedy tokens 0..n-1 of the reference sequence with BOS in front.
std::vector<int> prompt(int n) {
  std::vector<int> t = {1};
  for (int i = 0; static_cast<int>(t.size()) < n; ++i) t.push_back(kReference[i]);
  return t;
}

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/kvxfer_model_test_" +
         std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" + name;
}

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_all(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

// ---------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------
TEST(Llama2, ConfigMatchesHeader) {
  REQUIRE_MODEL(m);
  const km::Config& c = m->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(c.head_size(), 8);
  EXPECT_EQ(c.kv_dim(), 32);
}

TEST(Llama2, GreedyDecodeMatchesReference) {
  REQUIRE_MODEL(m);
  km::KVCache tail;  // shaped automatically
  std::vector<float> logits;
  std::string err;
  int token = 1;
  std::vector<int> got;
  for (int pos = 0; pos < static_cast<int>(kReference.size()); ++pos) {
    ASSERT_TRUE(m->decode_step(token, pos, km::KVView{}, &tail, &logits, &err)) << err;
    ASSERT_EQ(logits.size(), 512u);
    token = argmax(logits);
    got.push_back(token);
  }
  EXPECT_EQ(got, kReference);
  EXPECT_EQ(tail.n_tokens(), 20);
}

TEST(Llama2, PrefillThenDecodeMatchesDecodingFromScratch) {
  REQUIRE_MODEL(m);
  const std::vector<int> toks = prompt(12);
  std::string err;

  // From scratch: one token at a time.
  km::KVCache scratch;
  std::vector<float> logits;
  for (int p = 0; p < static_cast<int>(toks.size()); ++p)
    ASSERT_TRUE(m->decode_step(toks[p], p, km::KVView{}, &scratch, &logits, &err)) << err;

  km::PrefillResult pre;
  km::PrefillOptions opt;
  opt.all_logits = true;
  ASSERT_TRUE(m->prefill(toks, opt, &pre, &err)) << err;
  ASSERT_EQ(pre.kv.n_tokens(), 12);
  ASSERT_EQ(pre.last_logits.size(), 512u);
  ASSERT_EQ(pre.all_logits.size(), 12u * 512u);
  EXPECT_LE(rel_diff(logits.data(), pre.last_logits.data(), 512), 1e-5);
  EXPECT_EQ(argmax(logits), argmax(pre.last_logits));
  EXPECT_EQ(argmax(pre.last_logits), kReference[11]);
  for (int p = 0; p + 1 < 12; ++p)  // greedy continuation is the next prompt token
    EXPECT_EQ(argmax(pre.all_logits, p, 512), toks[p + 1]) << "position " << p;

  // The cache itself matches.
  for (int l = 0; l < 5; ++l)
    EXPECT_LE(rel_diff(scratch.k(l), pre.kv.k(l), 12 * 32), 1e-5) << "layer " << l;

  // Continue: decode over the prefill view vs. the scratch cache.
  km::KVCache tail;
  std::vector<float> a, b;
  int tok = kReference[11];
  for (int p = 12; p < 20; ++p) {
    ASSERT_TRUE(m->decode_step(tok, p, pre.kv.view(), &tail, &a, &err)) << err;
    ASSERT_TRUE(m->decode_step(tok, p, km::KVView{}, &scratch, &b, &err)) << err;
    EXPECT_LE(rel_diff(b.data(), a.data(), 512), 1e-5) << "position " << p;
    ASSERT_EQ(argmax(a), argmax(b));
    EXPECT_EQ(argmax(a), kReference[p]);
    tok = argmax(a);
  }
}

TEST(Llama2, VerifyEqualsSequentialDecode) {
  REQUIRE_MODEL(m);
  std::string err;
  km::PrefillResult pre;
  ASSERT_TRUE(m->prefill(prompt(8), {}, &pre, &err)) << err;
  const km::KVView view = pre.kv.view();

  // A draft that is partly wrong: greedy tokens with a substitution.
  std::vector<int> draft = {kReference[7], kReference[8], kReference[9], 77, kReference[11], 5};
  km::KVCache seq_tail, ver_tail;
  std::vector<float> seq((draft.size()) * 512), step, ver;
  for (std::size_t i = 0; i < draft.size(); ++i) {
    ASSERT_TRUE(m->decode_step(draft[i], 8 + static_cast<int>(i), view, &seq_tail, &step, &err))
        << err;
    std::copy(step.begin(), step.end(), seq.begin() + static_cast<std::ptrdiff_t>(i * 512));
  }
  ASSERT_TRUE(m->verify(draft, 8, view, &ver_tail, &ver, &err)) << err;
  ASSERT_EQ(ver.size(), draft.size() * 512);
  for (std::size_t i = 0; i < draft.size(); ++i) {
    EXPECT_LE(rel_diff(seq.data() + i * 512, ver.data() + i * 512, 512), 1e-4) << "row " << i;
    EXPECT_EQ(argmax(seq, i, 512), argmax(ver, i, 512)) << "row " << i;
  }
  ASSERT_EQ(ver_tail.n_tokens(), 6);
  EXPECT_LE(rel_diff(seq_tail.v(4), ver_tail.v(4), 6 * 32), 1e-5);

  // Accept the first 3 tokens, roll back the rest, continue: same as a
  // tail that only ever saw those 3 tokens.
  ver_tail.truncate(3);
  km::KVCache clean;
  ASSERT_TRUE(m->verify({draft[0], draft[1], draft[2]}, 8, view, &clean, nullptr, &err)) << err;
  std::vector<float> x, y;
  ASSERT_TRUE(m->decode_step(kReference[10], 11, view, &ver_tail, &x, &err)) << err;
  ASSERT_TRUE(m->decode_step(kReference[10], 11, view, &clean, &y, &err)) << err;
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float)));
}

// verify with layer_ready: the hook sees layers 0..n-1 in order before each
// is read, the bits equal the plain pass, and a false stops the pass.
TEST(Llama2, VerifyWaitsForEachLayerAndKeepsTheBits) {
  REQUIRE_MODEL(m);
  std::string err;
  km::PrefillResult pre;
  ASSERT_TRUE(m->prefill(prompt(8), {}, &pre, &err)) << err;
  const km::KVView view = pre.kv.view();
  const std::vector<int> draft = {kReference[7], kReference[8], 77};
  km::KVCache plain_tail, hooked_tail;
  std::vector<float> plain, hooked;
  ASSERT_TRUE(m->verify(draft, 8, view, &plain_tail, &plain, &err)) << err;
  std::vector<int> seen;
  ASSERT_TRUE(m->verify(draft, 8, view, &hooked_tail, &hooked, &err, [&](int l) {
    seen.push_back(l);
    return true;
  })) << err;
  std::vector<int> all(static_cast<size_t>(m->config().n_layers));
  for (size_t l = 0; l < all.size(); ++l) all[l] = static_cast<int>(l);
  EXPECT_EQ(seen, all);
  ASSERT_EQ(plain.size(), hooked.size());
  EXPECT_EQ(0, std::memcmp(plain.data(), hooked.data(), plain.size() * sizeof(float)));
  ASSERT_EQ(hooked_tail.n_tokens(), plain_tail.n_tokens());
  EXPECT_EQ(0, std::memcmp(plain_tail.k(m->config().n_layers - 1),
                           hooked_tail.k(m->config().n_layers - 1),
                           plain_tail.n_tokens() * m->config().kv_dim() * sizeof(float)));
  seen.clear();
  km::KVCache stopped;
  EXPECT_FALSE(m->verify(draft, 8, view, &stopped, nullptr, &err, [&](int l) {
    seen.push_back(l);
    return l < 2;
  }));
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
  EXPECT_NE(err.find("layer 2"), std::string::npos) << err;
}

TEST(Llama2, ExternalViewIsReallyUsed) {
  REQUIRE_MODEL(m);
  std::string err;
  const int n = 16;
  km::PrefillResult pre;
  ASSERT_TRUE(m->prefill(prompt(n), {}, &pre, &err)) << err;
  const int L = 5, kv = 32;
  const std::size_t stride = kv + 3;  // padded rows

  std::vector<std::vector<float>> kbuf(L), vbuf(L);
  km::KVView ext;
  ext.n_tokens = n;
  for (int l = 0; l < L; ++l) {
    kbuf[l].assign(n * stride, -7.0f);
    vbuf[l].assign(n * stride, -7.0f);
    for (int t = 0; t < n; ++t) {
      std::copy_n(pre.kv.k(l) + t * kv, kv, kbuf[l].begin() + t * stride);
      std::copy_n(pre.kv.v(l) + t * kv, kv, vbuf[l].begin() + t * stride);
    }
    ext.layers.push_back({kbuf[l].data(), vbuf[l].data(), stride, stride});
  }

  km::KVCache t1, t2;
  std::vector<float> a, b;
  ASSERT_TRUE(m->decode_step(kReference[n - 1], n, pre.kv.view(), &t1, &a, &err)) << err;
  ASSERT_TRUE(m->decode_step(kReference[n - 1], n, ext, &t2, &b, &err)) << err;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));

  // Perturb the copy's V of one layer: logits must change.
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < kv; ++c) vbuf[2][t * stride + c] += 0.25f * ((t + c) % 3 - 1);
  km::KVCache t3;
  std::vector<float> c3;
  ASSERT_TRUE(m->decode_step(kReference[n - 1], n, ext, &t3, &c3, &err)) << err;
  EXPECT_GT(rel_diff(a.data(), c3.data(), a.size()), 1e-4);

  // Attention outputs of recorded queries: identical on the exact view,
  // measurably different on the perturbed one.
  km::PrefillResult rq;
  km::PrefillOptions opt;
  opt.record_queries = true;
  ASSERT_TRUE(m->prefill(prompt(n), opt, &rq, &err)) << err;
  ASSERT_EQ(rq.queries.size(), static_cast<std::size_t>(L) * n * 64);
  std::vector<float> o_ref(rq.queries.size()), o_hat(rq.queries.size());
  ASSERT_TRUE(m->attention_outputs(rq.queries.data(), n, 0, rq.kv.view(), o_ref.data(), &err))
      << err;
  ASSERT_TRUE(m->attention_outputs(rq.queries.data(), n, 0, ext, o_hat.data(), &err)) << err;
  const std::size_t per_layer = static_cast<std::size_t>(n) * 64;
  for (int l = 0; l < L; ++l) {
    const double e =
        km::vnmse(o_ref.data() + l * per_layer, o_hat.data() + l * per_layer, per_layer);
    if (l == 2)
      EXPECT_GT(e, 1e-4);
    else
      EXPECT_EQ(e, 0.0) << "layer " << l;
  }
  // Queries at position 0 attend only to key 0, so the output is V row 0.
  for (int h = 0; h < 8; ++h)
    for (int d = 0; d < 8; ++d) EXPECT_EQ(o_ref[h * 8 + d], rq.kv.v(0)[(h / 2) * 8 + d]);
}

// Scoring over a view: over the prompt's own KV, every row has prefill's
// bits (whole sequence and a later chunk); a changed V row changes the rows
// from its position on and none before it.
TEST(Llama2, ScoreOverViewEqualsPrefillAndIsCausal) {
  REQUIRE_MODEL(m);
  std::string err;
  const int n = 20;
  const std::vector<int> toks = prompt(n);
  km::PrefillOptions opt;
  opt.all_logits = true;
  km::PrefillResult pre;
  ASSERT_TRUE(m->prefill(toks, opt, &pre, &err)) << err;
  const std::size_t V = 512;
  std::vector<float> all, part;
  ASSERT_TRUE(m->score_over_view(toks, 0, pre.kv.view(), &all, &err)) << err;
  ASSERT_EQ(all.size(), n * V);
  EXPECT_EQ(0, std::memcmp(all.data(), pre.all_logits.data(), all.size() * sizeof(float)));
  const std::vector<int> tail(toks.begin() + 12, toks.end());
  ASSERT_TRUE(m->score_over_view(tail, 12, pre.kv.view(), &part, &err)) << err;
  ASSERT_EQ(part.size(), tail.size() * V);
  for (std::size_t i = 0; i < tail.size(); ++i)
    EXPECT_LE(rel_diff(part.data() + i * V, pre.all_logits.data() + (12 + i) * V, V), 1e-5)
        << "row " << 12 + i;

  km::KVCache changed = pre.kv;
  for (int c = 0; c < 32; ++c) changed.v(2)[10 * 32 + c] += 0.5f;
  std::vector<float> ch;
  ASSERT_TRUE(m->score_over_view(toks, 0, changed.view(), &ch, &err)) << err;
  EXPECT_EQ(0, std::memcmp(ch.data(), all.data(), 10 * V * sizeof(float)));
  for (int i = 10; i < n; ++i)
    EXPECT_GT(rel_diff(ch.data() + i * V, all.data() + i * V, V), 1e-6) << "row " << i;

  // Dropping a row is not zeroing it: rows 0..9 keep their bits, later ones
  // move.
  std::vector<std::uint8_t> drop(n, 0);
  drop[10] = 1;
  km::KVView dv = pre.kv.view();
  for (auto& lv : dv.layers) lv.drop = drop.data();
  ASSERT_TRUE(m->score_over_view(toks, 0, dv, &ch, &err)) << err;
  EXPECT_EQ(0, std::memcmp(ch.data(), all.data(), 10 * V * sizeof(float)));
  EXPECT_GT(rel_diff(ch.data() + 10 * V, all.data() + 10 * V, V), 1e-6);

  // Bad arguments.
  EXPECT_FALSE(m->score_over_view(toks, 1, pre.kv.view(), &ch, &err));
  EXPECT_NE(err.find("not all in the view"), std::string::npos) << err;
  EXPECT_FALSE(m->score_over_view(toks, -1, pre.kv.view(), &ch, &err));
  drop[0] = 1;
  EXPECT_FALSE(m->score_over_view(toks, 0, dv, &ch, &err));
  EXPECT_NE(err.find("drops token 0"), std::string::npos) << err;
  EXPECT_FALSE(m->score_over_view(toks, 0, pre.kv.view(), nullptr, &err));
  EXPECT_FALSE(m->score_over_view({}, 0, pre.kv.view(), &ch, &err));
  EXPECT_FALSE(m->decode_step(1, 0, km::KVView{}, nullptr, &ch, &err));
  EXPECT_NE(err.find("tail cache is null"), std::string::npos) << err;
  EXPECT_FALSE(m->verify({1, 2}, 0, km::KVView{}, nullptr, &ch, &err));
  EXPECT_NE(err.find("tail cache is null"), std::string::npos) << err;
}

TEST(Llama2, DeterministicAcrossThreadCounts) {
  REQUIRE_MODEL(m);
  std::string err;
  std::vector<int> toks(200);
  for (int i = 0; i < 200; ++i) toks[i] = (i * 37 + 1) % 512;
  km::PrefillOptions opt;
  opt.record_queries = true;
  const int saved = omp_get_max_threads();
  km::PrefillResult r1, r4;
  omp_set_num_threads(1);
  ASSERT_TRUE(m->prefill(toks, opt, &r1, &err)) << err;
  omp_set_num_threads(4);
  ASSERT_TRUE(m->prefill(toks, opt, &r4, &err)) << err;
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(r1.last_logits.data(), r4.last_logits.data(), 512 * sizeof(float)));
  EXPECT_EQ(0,
            std::memcmp(r1.queries.data(), r4.queries.data(), r1.queries.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(r1.kv.k(4), r4.kv.k(4), 200 * 32 * sizeof(float)));
}

TEST(Llama2, RejectsBadArguments) {
  REQUIRE_MODEL(m);
  std::string err;
  km::KVCache tail;
  std::vector<float> logits;
  EXPECT_FALSE(m->decode_step(1, 3, km::KVView{}, &tail, &logits, &err));  // pos != 0
  EXPECT_NE(err.find("position"), std::string::npos) << err;
  EXPECT_EQ(tail.n_tokens(), 0);
  err.clear();
  EXPECT_FALSE(m->decode_step(512, 0, km::KVView{}, &tail, &logits, &err));
  EXPECT_NE(err.find("token id"), std::string::npos) << err;
  err.clear();
  km::PrefillResult pre;
  EXPECT_FALSE(m->prefill(std::vector<int>(513, 1), {}, &pre, &err));
  EXPECT_NE(err.find("seq_len"), std::string::npos) << err;
  err.clear();
  EXPECT_FALSE(m->prefill({}, {}, &pre, &err));
  EXPECT_FALSE(err.empty());
  km::KVCache wrong(3, 32);
  err.clear();
  EXPECT_FALSE(m->decode_step(1, 0, km::KVView{}, &wrong, &logits, &err));
  EXPECT_NE(err.find("shape"), std::string::npos) << err;
}

TEST(Llama2, LoadFailsWithMessage) {
  std::string err;
  EXPECT_EQ(km::Model::load("/nonexistent/dir/model.bin", &err), nullptr);
  EXPECT_NE(err.find("cannot open model file"), std::string::npos) << err;
  EXPECT_NE(err.find("No such file"), std::string::npos) << err;

  // A name ending in .gguf without the magic: both formats are named.
  const std::string fake = temp_path("fake.gguf");
  write_all(fake, std::vector<char>(64, 'x'));
  err.clear();
  EXPECT_EQ(km::Model::load(fake, &err), nullptr);
  EXPECT_NE(err.find("neither a GGUF file"), std::string::npos) << err;
  EXPECT_NE(err.find("llama2.c checkpoint: "), std::string::npos) << err;

  const std::vector<char> good = read_all(kModelPath);
  ASSERT_EQ(good.size(), 1056540u) << "reference checkpoint missing or wrong: " << kModelPath;

  const std::string trunc = temp_path("trunc.bin");
  write_all(trunc, std::vector<char>(good.begin(), good.begin() + 100000));
  err.clear();
  EXPECT_EQ(km::Model::load(trunc, &err), nullptr);
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;

  const std::string tiny = temp_path("tiny.bin");
  write_all(tiny, std::vector<char>(good.begin(), good.begin() + 10));
  err.clear();
  EXPECT_EQ(km::Model::load(tiny, &err), nullptr);
  EXPECT_NE(err.find("too small"), std::string::npos) << err;

  // n_heads = 7 does not divide dim = 64 (file size unchanged).
  std::vector<char> bad = good;
  const std::int32_t seven = 7;
  std::memcpy(bad.data() + 3 * 4, &seven, 4);
  const std::string badh = temp_path("badheader.bin");
  write_all(badh, bad);
  err.clear();
  EXPECT_EQ(km::Model::load(badh, &err), nullptr);
  EXPECT_NE(err.find("bad llama2.c header"), std::string::npos) << err;

  // Negative dimension.
  bad = good;
  const std::int32_t neg = -64;
  std::memcpy(bad.data(), &neg, 4);
  write_all(badh, bad);
  err.clear();
  EXPECT_EQ(km::Model::load(badh, &err), nullptr);
  EXPECT_NE(err.find("bad llama2.c header"), std::string::npos) << err;

  // Trailing garbage.
  bad = good;
  bad.push_back('x');
  const std::string longer = temp_path("long.bin");
  write_all(longer, bad);
  err.clear();
  EXPECT_EQ(km::Model::load(longer, &err), nullptr);
  EXPECT_NE(err.find("implies"), std::string::npos) << err;

  std::remove(trunc.c_str());
  std::remove(tiny.c_str());
  std::remove(badh.c_str());
  std::remove(longer.c_str());
}

// ---------------------------------------------------------------------------
// Synthetic KV
// ---------------------------------------------------------------------------
namespace {
km::SyntheticKVSpec big_spec(std::uint64_t seed) {
  km::SyntheticKVSpec s;
  s.seed = seed;
  s.n_layers = 32;
  s.n_kv_heads = 8;
  s.head_dim = 128;
  return s;
}
}  // namespace

TEST(SyntheticKV, PureFunctionOfIndex) {
  const km::SyntheticKVSpec s = big_spec(42);
  const int H = s.row_channels();
  std::string err;
  for (km::KVKind kind : {km::KVKind::kKey, km::KVKind::kValue}) {
    std::vector<float> full(100 * H), part(50 * H);
    ASSERT_TRUE(km::fill_synthetic_kv(s, 7, kind, 0, 100, full.data(), 0, &err)) << err;
    ASSERT_TRUE(km::fill_synthetic_kv(s, 7, kind, 50, 50, part.data(), 0, &err)) << err;
    EXPECT_EQ(0, std::memcmp(full.data() + 50 * H, part.data(), part.size() * sizeof(float)));
    std::vector<float> again(100 * H);
    ASSERT_TRUE(km::fill_synthetic_kv(s, 7, kind, 0, 100, again.data(), 0, &err)) << err;
    EXPECT_EQ(0, std::memcmp(full.data(), again.data(), full.size() * sizeof(float)));
    // Single values agree bit for bit with the filled buffer.
    for (int t : {0, 1, 63, 99})
      for (int c : {0, 1, 2, 127, 128, 129, 511, 1022, 1023}) {
        const float v = km::synthetic_kv_value(s, 7, kind, t, c);
        EXPECT_EQ(0, std::memcmp(&v, &full[t * H + c], sizeof(float))) << "t=" << t << " c=" << c;
      }
    // Strided fill leaves the padding untouched and matches.
    const std::size_t stride = H + 5;
    std::vector<float> padded(10 * stride, 123.0f);
    ASSERT_TRUE(km::fill_synthetic_kv(s, 7, kind, 90, 10, padded.data(), stride, &err)) << err;
    for (int t = 0; t < 10; ++t) {
      EXPECT_EQ(0, std::memcmp(&padded[t * stride], &full[(90 + t) * H], H * sizeof(float)));
      EXPECT_EQ(padded[t * stride + H], 123.0f);
    }
  }
}

TEST(SyntheticKV, SeedsLayersAndKindsDiffer) {
  std::string err;
  const int H = 1024;
  std::vector<float> a(16 * H), b(16 * H), c(16 * H), d(16 * H);
  ASSERT_TRUE(km::fill_synthetic_kv(big_spec(1), 0, km::KVKind::kKey, 0, 16, a.data(), 0, &err));
  ASSERT_TRUE(km::fill_synthetic_kv(big_spec(2), 0, km::KVKind::kKey, 0, 16, b.data(), 0, &err));
  ASSERT_TRUE(km::fill_synthetic_kv(big_spec(1), 1, km::KVKind::kKey, 0, 16, c.data(), 0, &err));
  ASSERT_TRUE(km::fill_synthetic_kv(big_spec(1), 0, km::KVKind::kValue, 0, 16, d.data(), 0, &err));
  int same_ab = 0, same_ac = 0, same_ad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    same_ab += a[i] == b[i];
    same_ac += a[i] == c[i];
    same_ad += a[i] == d[i];
  }
  EXPECT_LT(same_ab, 10);
  EXPECT_LT(same_ac, 10);
  EXPECT_LT(same_ad, 10);
  EXPECT_NE(km::synthetic_key_outlier_channels(big_spec(1), 0),
            km::synthetic_key_outlier_channels(big_spec(2), 0));
}

TEST(SyntheticKV, OutlierChannelsAndValueStatistics) {
  std::string err;
  for (bool rope : {true, false}) {
    km::SyntheticKVSpec s = big_spec(9);
    s.rope = rope;
    const int H = s.row_channels(), T = 256, layer = 3;
    const std::vector<int> outl = km::synthetic_key_outlier_channels(s, layer);
    ASSERT_EQ(outl.size(), 8u);  // 4 pairs
    for (int c : outl) EXPECT_GE(c % 128, 64) << "outliers sit in the low-frequency half";
    std::vector<float> k(T * H), v(T * H);
    ASSERT_TRUE(km::fill_synthetic_kv(s, layer, km::KVKind::kKey, 1000, T, k.data(), 0, &err));
    ASSERT_TRUE(km::fill_synthetic_kv(s, layer, km::KVKind::kValue, 1000, T, v.data(), 0, &err));

    auto channel_ms = [&](const std::vector<float>& x, int c) {
      double s2 = 0;
      for (int t = 0; t < T; ++t) s2 += static_cast<double>(x[t * H + c]) * x[t * H + c];
      return s2 / T;
    };
    double out_ms = 0, bulk_ms = 0;
    for (int c = 0; c < H; ++c) {
      const bool is_out = std::find(outl.begin(), outl.end(), c) != outl.end();
      (is_out ? out_ms : bulk_ms) += channel_ms(k, c);
    }
    out_ms /= outl.size();
    bulk_ms /= (H - outl.size());
    const double ratio = std::sqrt(out_ms / bulk_ms);
    EXPECT_GT(ratio, 30.0) << "rope=" << rope;
    EXPECT_LT(ratio, 300.0) << "rope=" << rope;
    // Each outlier channel individually stands far above the bulk.
    for (int c : outl) EXPECT_GT(std::sqrt(channel_ms(k, c) / bulk_ms), 20.0) << "channel " << c;

    // Values: no channel stands out.
    double vmax = 0, vsum = 0;
    for (int c = 0; c < H; ++c) {
      const double ms = channel_ms(v, c);
      vmax = std::max(vmax, ms);
      vsum += ms;
    }
    EXPECT_LT(std::sqrt(vmax / (vsum / H)), 3.0);
  }
}

TEST(SyntheticKV, RejectsBadSpecs) {
  std::string err;
  km::SyntheticKVSpec s = big_spec(1);
  s.head_dim = 7;
  std::vector<float> buf(8 * 8);
  EXPECT_FALSE(km::fill_synthetic_kv(s, 0, km::KVKind::kKey, 0, 1, buf.data(), 0, &err));
  EXPECT_NE(err.find("even"), std::string::npos) << err;
  s = big_spec(1);
  EXPECT_FALSE(km::fill_synthetic_kv(s, 32, km::KVKind::kKey, 0, 1, buf.data(), 0, &err));
  EXPECT_FALSE(km::fill_synthetic_kv(s, 0, km::KVKind::kKey, 0, 1, buf.data(), 10, &err));
  // Tiny shape: 1 head x 2 channels still gets its single candidate pair.
  s.n_kv_heads = 1;
  s.head_dim = 2;
  EXPECT_EQ(km::synthetic_key_outlier_channels(s, 0).size(), 2u);
}

// SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0), fetched by scripts/install-deps.sh.
#include "models/model_paths.h"

namespace {

struct SmolLM2Model {
  std::unique_ptr<km::Model> model;  // null if unavailable
  std::string why;                   // why it is unavailable
  bool present = false;              // the file exists: not loading it is a failure
};

const SmolLM2Model& smollm2() {
  static const SmolLM2Model s = [] {
    SmolLM2Model r;
    const std::string path = km::smollm2_gguf_path();
    if (!std::ifstream(path).good()) {
      r.why = path + " is absent; scripts/install-deps.sh fetches it";
      return r;
    }
    r.present = true;
    r.model = km::Model::load(path, &r.why);
    if (!r.model) r.why = "cannot load " + path + ": " + r.why;
    return r;
  }();
  return s;
}

// Skips when the GGUF is absent; fails when it is present but does not load.
#define REQUIRE_SMOLLM2()                                                                  \
  const km::Model* m = smollm2().model.get();                                              \
  if (m == nullptr) {                                                                      \
    if (smollm2().present) FAIL() << "SmolLM2 is present but unusable: " << smollm2().why; \
    GTEST_SKIP() << smollm2().why;                                                         \
  }                                                                                        \
  std::string why

// "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
// with the default system turn, as SmolLM2's tokenizer encodes it.
const std::vector<int> kChat = {1,    9690, 198,   2683, 359,  253,  5356, 5646,  11173, 3365,
                                3511, 308,  34519, 28,   7018, 411,  407,  19712, 8182,  2,
                                198,  1,    4093,  198,  1780, 314,  260,  3575,  282,   4649,
                                47,   2,    198,   1,    520,  9531, 198};

TEST(SmolLM2, LoadsTheArchitectureFromTheGguf) {
  REQUIRE_SMOLLM2();
  const km::Config& c = m->config();
  EXPECT_EQ(c.format, "gguf");
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.dim, 576);
  EXPECT_EQ(c.hidden_dim, 1536);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.seq_len, 8192);
  EXPECT_EQ(c.rope_base, 100000.0f);
  EXPECT_TRUE(c.shared_classifier);
}

// Greedy answer to the chat prompt: "The capital of France is Paris." then
// <|im_end|> (a float64 numpy forward pass of the dequantized weights gives
// the same tokens).
TEST(SmolLM2, AnswersTheChatPrompt) {
  REQUIRE_SMOLLM2();
  km::PrefillResult pr;
  ASSERT_TRUE(m->prefill(kChat, {}, &pr, &why)) << why;
  std::vector<int> out = {argmax(pr.last_logits)};
  km::KVCache tail;
  std::vector<float> logits;
  const km::KVView view = pr.kv.view();
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(
        m->decode_step(out.back(), static_cast<int>(kChat.size()) + i, view, &tail, &logits, &why))
        << why;
    out.push_back(argmax(logits));
  }
  EXPECT_EQ(out, (std::vector<int>{504, 3575, 282, 4649, 314, 7042, 30, 2}));
}

// The batched passes give every token the bits of one-token decoding: a
// verification pass over 9 tokens equals 9 decode steps (logits and KV rows),
// and a prefill of the whole sequence equals prefill of a prefix plus steps.
TEST(SmolLM2, BatchedPassesAreBitIdenticalToSequentialDecoding) {
  REQUIRE_SMOLLM2();
  const int n0 = static_cast<int>(kChat.size());
  km::PrefillResult pr;
  ASSERT_TRUE(m->prefill(kChat, {}, &pr, &why)) << why;
  const std::vector<int> draft = {520, 504, 3575, 282, 4649, 314, 7042, 30, 2};
  const km::KVView view = pr.kv.view();
  const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
  km::KVCache seq_tail, batch_tail;
  std::vector<float> seq_logits, step, batch_logits;
  for (std::size_t i = 0; i < draft.size(); ++i) {
    ASSERT_TRUE(m->decode_step(draft[i], n0 + static_cast<int>(i), view, &seq_tail, &step, &why))
        << why;
    seq_logits.insert(seq_logits.end(), step.begin(), step.end());
  }
  ASSERT_TRUE(m->verify(draft, n0, view, &batch_tail, &batch_logits, &why)) << why;
  ASSERT_EQ(batch_logits.size(), draft.size() * V);
  EXPECT_EQ(std::memcmp(batch_logits.data(), seq_logits.data(), batch_logits.size() * 4), 0);
  const std::size_t kv = static_cast<std::size_t>(m->config().kv_dim()) * draft.size();
  for (int l = 0; l < m->config().n_layers; ++l) {
    EXPECT_EQ(std::memcmp(batch_tail.k(l), seq_tail.k(l), kv * 4), 0) << "K of layer " << l;
    EXPECT_EQ(std::memcmp(batch_tail.v(l), seq_tail.v(l), kv * 4), 0) << "V of layer " << l;
  }
  std::vector<int> all = kChat;
  all.insert(all.end(), draft.begin(), draft.end());
  km::PrefillResult whole;
  ASSERT_TRUE(m->prefill(all, {}, &whole, &why)) << why;
  EXPECT_EQ(std::memcmp(whole.last_logits.data(), step.data(), V * 4), 0);

  // Scoring the draft over the whole sequence's own KV gives verification's
  // bits too (the products and attention are batch-independent).
  std::vector<float> scored;
  ASSERT_TRUE(m->score_over_view(draft, n0, whole.kv.view(), &scored, &why)) << why;
  ASSERT_EQ(scored.size(), batch_logits.size());
  EXPECT_EQ(std::memcmp(scored.data(), batch_logits.data(), scored.size() * 4), 0);
}

// pin_openmp_threads: thread i of the team runs on the i-th CPU of the
// process's mask, and only there; the masks are restored afterwards.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  std::vector<int> v;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) v.push_back(c);
  return v;
}

TEST(CpuAffinity, PinsEachThreadToItsOwnCpu) {
  const std::vector<int> cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  const int n = std::min<int>(2, static_cast<int>(cpus.size()));
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c : cpus) CPU_SET(c, &all);
  std::string err;
  ASSERT_TRUE(kvxfer::model::pin_openmp_threads(n, &err)) << err;
  std::vector<std::vector<int>> seen(static_cast<size_t>(n));
#pragma omp parallel num_threads(n)
  {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    if (pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &mine)) seen[static_cast<size_t>(omp_get_thread_num())].push_back(c);
    pthread_setaffinity_np(pthread_self(), sizeof all, &all);  // restore
  }
  for (int i = 0; i < n; ++i)
    EXPECT_EQ(seen[static_cast<size_t>(i)], std::vector<int>{cpus[static_cast<size_t>(i)]})
        << "thread " << i;
}

TEST(CpuAffinity, RefusesMoreThreadsThanCpus) {
  const std::vector<int> cpus = allowed_cpus();
  std::string err;
  EXPECT_FALSE(kvxfer::model::pin_openmp_threads(static_cast<int>(cpus.size()) + 1, &err));
  EXPECT_NE(err.find("the affinity mask has " + std::to_string(cpus.size()) + " CPU"),
            std::string::npos)
      << err;
  EXPECT_EQ(allowed_cpus(), cpus);  // nothing pinned
  EXPECT_FALSE(kvxfer::model::pin_openmp_threads(0, &err));
  EXPECT_NE(err.find("n = 0"), std::string::npos) << err;
}

}  // namespace
