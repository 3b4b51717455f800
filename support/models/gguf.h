// Reader for GGUF model files (versions 2 and 3), the format of llama.cpp.
//
// The file is memory-mapped read-only.  open() validates everything before
// returning: the magic and version, every metadata key and value (types,
// string and array lengths against the file size), and every tensor (name,
// rank 1..4, element type, shape, overflow-safe byte size, data offset aligned
// to general.alignment and inside the file, no two tensors overlapping).  A
// bad file is refused with a message that names the field, e.g.
//   "gguf 'x.gguf': tensor 'blk.0.attn_q.weight': data [..] ends past the end
//    of the file (98362432 bytes)".
// Source of the layout: ggml/docs/gguf.md (the GGUF specification) and
// ggml-common.h (block_q4_1, block_q8_0).
//
// Threading: a File is immutable after open(); every const member may be
// called from any thread.  Pointers into the mapping (TensorInfo::data) stay
// valid until the File is destroyed.  No exception crosses this API except
// std::bad_alloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvxfer::model::gguf {

// Metadata value types (gguf_type).
enum class ValueType : std::uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// Tensor element types this reader accepts (ggml_type); any other type is
// refused at open() with "unsupported tensor type N".
enum class TensorType : std::uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_1 = 3,  // blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d*q + m
  kQ8_0 = 8,  // blocks of 32: fp16 d, 32 int8; w = d*q
};

// Elements per block and bytes per block of a tensor type.
int block_elements(TensorType type);
int block_bytes(TensorType type);
const char* type_name(TensorType type);

struct TensorInfo {
  std::string name;
  int n_dims = 0;                      // 1..4
  std::uint64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the contiguous dimension
  TensorType type = TensorType::kF32;
  std::uint64_t offset = 0;            // from the start of the data section
  const std::uint8_t* data = nullptr;  // into the mapping
  std::uint64_t n_bytes = 0;

  std::uint64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  // Bytes of one row (ne[0] elements).
  std::uint64_t row_bytes() const;
};

class File {
 public:
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Maps and validates `path`; nullptr and *error on failure.
  static std::unique_ptr<File> open(const std::string& path, std::string* error);

  const std::string& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t file_size() const { return size_; }

  // Typed metadata lookups.  Each returns false and sets *error (naming the
  // key) when the key is absent or has another type.  Integer getters accept
  // any integer type whose value fits; get_f32 accepts float32 or float64.
  bool has(const std::string& key) const;
  bool get_u32(const std::string& key, std::uint32_t* out, std::string* error) const;
  bool get_f32(const std::string& key, float* out, std::string* error) const;
  bool get_bool(const std::string& key, bool* out, std::string* error) const;
  bool get_string(const std::string& key, std::string* out, std::string* error) const;
  bool get_string_array(const std::string& key, std::vector<std::string>* out,
                        std::string* error) const;
  bool get_i32_array(const std::string& key, std::vector<std::int32_t>* out,
                     std::string* error) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorInfo* tensor(const std::string& name) const;
  // The tensor `name` with exactly the shape {ne0, ne1} (ne1 = 1 for a
  // vector) and one of `types`; nullptr and *error naming the tensor and the
  // field otherwise ("tensor 'x': shape [576, 49152], expected [576, 1536]").
  const TensorInfo* expect(const std::string& name, std::uint64_t ne0, std::uint64_t ne1,
                           const std::vector<TensorType>& types, std::string* error) const;

 private:
  struct Value;
  File() = default;
  const Value* find(const std::string& key) const;

  std::string path_;
  std::uint32_t version_ = 0;
  const std::uint8_t* map_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<std::pair<std::string, std::unique_ptr<Value>>> kv_;
  std::vector<TensorInfo> tensors_;
};

// Whether the file at `path` begins with the GGUF magic (false when it cannot
// be read).  Says nothing about the rest of the file: open() validates it.
bool has_magic(const std::string& path);

// Dequantizes row `row` of `t` (ne[0] elements) into out (float32).
// Q4_1: w = d*q + m, Q8_0: w = d*q, with d, m converted from fp16 exactly and
// one float32 multiply and one float32 add (no fma), as ggml's
// dequantize_row_q4_1 / _q8_0; it is the runner's model::dequantize_row
// (qmatmul.h), which the products use.  Requires row < ne[1]*ne[2]*ne[3].
void dequantize_row(const TensorInfo& t, std::uint64_t row, float* out);

}  // namespace kvxfer::model::gguf
