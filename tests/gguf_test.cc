// Tests of the GGUF reader (models/gguf.h): a tampered file is refused
// naming the field, and the real SmolLM2 file reads to values computed
// independently by the Python `gguf` package (GGUFReader + quants.dequantize).
#include "models/gguf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "models/model_paths.h"

namespace gg = kvxfer::model::gguf;

namespace {

// Writes a GGUF file byte by byte, so each test can break one field.
class Builder {
 public:
  void u32(std::uint32_t v) { raw(&v, 4); }
  void u64(std::uint64_t v) { raw(&v, 8); }
  void f32(float v) { raw(&v, 4); }
  void str(const std::string& s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  void pad(std::size_t a) {
    while (bytes.size() % a != 0) bytes.push_back(0);
  }
  std::vector<std::uint8_t> bytes;
};

struct Spec {
  std::string magic = "GGUF";
  std::uint32_t version = 3;
  std::uint32_t tensor_type = 3;  // Q4_1
  std::uint64_t ne0 = 64, ne1 = 2;
  std::uint64_t offset = 0;
  std::size_t truncate = 0;  // bytes cut from the end
  bool dup_key = false;
};

// One metadata entry (a uint32 and a string array) and one Q4_1 tensor "w"
// of ne0 x ne1 whose every block has d = 1, m = -8 and q = j % 16.
std::string write_file(const Spec& s, const std::string& name) {
  Builder b;
  b.raw(s.magic.data(), 4);
  b.u32(s.version);
  b.u64(1);                  // tensors
  b.u64(s.dup_key ? 3 : 2);  // metadata
  b.str("llama.block_count");
  b.u32(4);  // uint32
  b.u32(30);
  b.str("tokenizer.ggml.tokens");
  b.u32(9);  // array
  b.u32(8);  // of string
  b.u64(2);
  b.str("a");
  b.str("bc");
  if (s.dup_key) {
    b.str("llama.block_count");
    b.u32(4);
    b.u32(31);
  }
  b.str("w");
  b.u32(2);
  b.u64(s.ne0);
  b.u64(s.ne1);
  b.u32(s.tensor_type);
  b.u64(s.offset);
  b.pad(32);
  for (std::uint64_t blk = 0; blk < s.ne0 * s.ne1 / 32; ++blk) {
    const std::uint16_t d = 0x3C00, m = 0xC800;  // 1.0, -8.0
    b.raw(&d, 2);
    b.raw(&m, 2);
    for (int j = 0; j < 16; ++j) {
      const std::uint8_t q = static_cast<std::uint8_t>((j % 16) | (((j + 16) % 16) << 4));
      b.raw(&q, 1);
    }
  }
  b.bytes.resize(b.bytes.size() - s.truncate);
  const std::string path = ::testing::TempDir() + "/gguf_test_" + name + ".gguf";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.bytes.data()),
             static_cast<std::streamsize>(b.bytes.size()));
  return path;
}

std::string open_error(const Spec& s, const std::string& name) {
  std::string error;
  auto f = gg::File::open(write_file(s, name), &error);
  EXPECT_EQ(f, nullptr);
  return error;
}

TEST(Gguf, ReadsAHandWrittenFile) {
  std::string error;
  auto f = gg::File::open(write_file(Spec{}, "good"), &error);
  ASSERT_NE(f, nullptr) << error;
  EXPECT_EQ(f->version(), 3u);
  std::uint32_t n = 0;
  ASSERT_TRUE(f->get_u32("llama.block_count", &n, &error)) << error;
  EXPECT_EQ(n, 30u);
  std::vector<std::string> tokens;
  ASSERT_TRUE(f->get_string_array("tokenizer.ggml.tokens", &tokens, &error)) << error;
  EXPECT_EQ(tokens, (std::vector<std::string>{"a", "bc"}));
  const gg::TensorInfo* t = f->expect("w", 64, 2, {gg::TensorType::kQ4_1}, &error);
  ASSERT_NE(t, nullptr) << error;
  EXPECT_EQ(t->n_bytes, 4u * 20u);
  EXPECT_EQ(t->row_bytes(), 40u);
  std::vector<float> row(64);
  gg::dequantize_row(*t, 1, row.data());
  for (int j = 0; j < 64; ++j) EXPECT_EQ(row[j], static_cast<float>(j % 16) - 8.0f) << j;
}

TEST(Gguf, WrongMagicIsRefused) {
  Spec s;
  s.magic = "GGUG";
  EXPECT_NE(open_error(s, "magic").find("bad magic"), std::string::npos);
}

TEST(Gguf, UnsupportedVersionIsRefused) {
  Spec s;
  s.version = 4;
  EXPECT_NE(open_error(s, "version").find("unsupported version 4"), std::string::npos);
}

TEST(Gguf, TruncatedTensorIsRefusedNamingIt) {
  Spec s;
  s.truncate = 1;
  const std::string e = open_error(s, "truncated");
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("past the end of the file"), std::string::npos) << e;
}

TEST(Gguf, TruncatedMetadataIsRefused) {
  Spec s;
  s.truncate = 200;  // into the metadata
  const std::string e = open_error(s, "truncated_meta");
  EXPECT_FALSE(e.empty());
}

TEST(Gguf, UnknownQuantTypeIsRefusedNamingIt) {
  Spec s;
  s.tensor_type = 12;  // Q4_K
  const std::string e = open_error(s, "qtype");
  EXPECT_NE(e.find("tensor 'w': unsupported tensor type 12"), std::string::npos) << e;
}

TEST(Gguf, MisalignedOffsetIsRefused) {
  Spec s;
  s.offset = 4;
  EXPECT_NE(open_error(s, "align").find("not aligned to 32"), std::string::npos);
}

TEST(Gguf, RowNotAMultipleOfTheBlockIsRefused) {
  Spec s;
  s.ne0 = 48;
  s.ne1 = 2;
  EXPECT_NE(open_error(s, "block").find("not a multiple of the Q4_1 block"), std::string::npos);
}

TEST(Gguf, DuplicateKeyIsRefused) {
  Spec s;
  s.dup_key = true;
  EXPECT_NE(open_error(s, "dup").find("appears twice"), std::string::npos);
}

TEST(Gguf, WrongShapeAndTypeAreRefusedByExpect) {
  std::string error;
  auto f = gg::File::open(write_file(Spec{}, "shape"), &error);
  ASSERT_NE(f, nullptr) << error;
  EXPECT_EQ(f->expect("w", 64, 3, {gg::TensorType::kQ4_1}, &error), nullptr);
  EXPECT_NE(error.find("tensor 'w': shape [64, 2], expected [64, 3]"), std::string::npos) << error;
  EXPECT_EQ(f->expect("w", 64, 2, {gg::TensorType::kQ8_0}, &error), nullptr);
  EXPECT_NE(error.find("type Q4_1, expected Q8_0"), std::string::npos) << error;
  EXPECT_EQ(f->expect("nope", 1, 1, {gg::TensorType::kF32}, &error), nullptr);
  EXPECT_NE(error.find("'nope' is missing"), std::string::npos) << error;
  std::string str;
  EXPECT_FALSE(f->get_string("llama.block_count", &str, &error));
  EXPECT_NE(error.find("has type uint32, expected string"), std::string::npos) << error;
}

TEST(Gguf, EveryTruncationIsRefusedWithoutACrash) {
  const std::string good = write_file(Spec{}, "every");
  std::ifstream in(good, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string path = ::testing::TempDir() + "/gguf_test_cut.gguf";
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(n));
    std::string error;
    EXPECT_EQ(gg::File::open(path, &error), nullptr) << "prefix of " << n << " bytes";
    EXPECT_FALSE(error.empty());
  }
}

// The real model (fetched by scripts/install-deps.sh).  Expected values from
// gguf 0.x: quants.dequantize(t.data, t.tensor_type), as float32 bits.
TEST(GgufSmolLM2, MetadataAndDequantizedRows) {
  const std::string path = kvxfer::model::smollm2_gguf_path();
  if (!std::ifstream(path).good())
    GTEST_SKIP() << "SmolLM2 not fetched (" << path << "); run scripts/install-deps.sh";
  std::string error;
  auto f = gg::File::open(path, &error);
  ASSERT_NE(f, nullptr) << error;
  EXPECT_EQ(f->file_size(), 98362432u);
  EXPECT_EQ(f->tensors().size(), 272u);
  std::uint32_t v = 0;
  ASSERT_TRUE(f->get_u32("llama.block_count", &v, &error));
  EXPECT_EQ(v, 30u);
  ASSERT_TRUE(f->get_u32("llama.attention.head_count_kv", &v, &error));
  EXPECT_EQ(v, 3u);
  float base = 0;
  ASSERT_TRUE(f->get_f32("llama.rope.freq_base", &base, &error));
  EXPECT_EQ(base, 100000.0f);
  std::string s;
  ASSERT_TRUE(f->get_string("tokenizer.ggml.pre", &s, &error));
  EXPECT_EQ(s, "smollm");

  struct Row {
    const char* name;
    std::uint64_t ne0, ne1;
    gg::TensorType type;
    std::uint64_t row;
    std::uint32_t bits[5];  // elements 0, 1, 17, 31, 33
    double sum;
  };
  const Row rows[] = {
      {"token_embd.weight",
       576,
       49152,
       gg::TensorType::kQ8_0,
       0,
       {3185193984u, 1023874048u, 1034646016u, 3192731392u, 3189440000u},
       -2.2541093826293945},
      {"token_embd.weight",
       576,
       49152,
       gg::TensorType::kQ8_0,
       49151,
       {1010597888u, 1002209280u, 1056972544u, 1060833024u, 1036261376u},
       -0.4662208557128906},
      {"blk.0.attn_q.weight",
       576,
       576,
       gg::TensorType::kQ4_1,
       5,
       {1033633792u, 3196887040u, 1033633792u, 1033633792u, 3202031616u},
       -3.731201171875},
      {"blk.29.ffn_down.weight",
       1536,
       576,
       gg::TensorType::kQ4_1,
       575,
       {3194662912u, 3173007360u, 3198550016u, 1053223936u, 1041674240u},
       -5.229949951171875},
  };
  for (const Row& r : rows) {
    const gg::TensorInfo* t = f->expect(r.name, r.ne0, r.ne1, {r.type}, &error);
    ASSERT_NE(t, nullptr) << error;
    std::vector<float> out(r.ne0);
    gg::dequantize_row(*t, r.row, out.data());
    const int idx[5] = {0, 1, 17, 31, 33};
    for (int i = 0; i < 5; ++i) {
      std::uint32_t b;
      std::memcpy(&b, &out[idx[i]], 4);
      EXPECT_EQ(b, r.bits[i]) << r.name << " row " << r.row << " element " << idx[i];
    }
    double sum = 0;
    for (float x : out) sum += x;
    EXPECT_NEAR(sum, r.sum, 1e-9 * r.ne0) << r.name;
  }
}

}  // namespace
