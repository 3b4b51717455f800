// GGUF reader; see gguf.h.  Layout (ggml/docs/gguf.md):
//   magic "GGUF", uint32 version, uint64 n_tensors, uint64 n_kv,
//   n_kv x { string key, uint32 type, value },
//   n_tensors x { string name, uint32 n_dims, uint64 ne[n_dims], uint32 type,
//                 uint64 offset },
//   padding to general.alignment (default 32), then the data section.
// A string is uint64 length + bytes; an array is uint32 type + uint64 count +
// elements.  Everything is little-endian.
#include "models/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "codec/codec_math.h"
#include "models/qmatmul.h"

namespace kvxfer::model::gguf {

// A metadata value: a scalar (kept as raw little-endian bytes in `raw`), a
// string, or an array of either (strings in `strings`, scalars in `raw`).
struct File::Value {
  ValueType type = ValueType::kUint8;
  ValueType elem = ValueType::kUint8;  // arrays only
  std::uint64_t count = 0;             // arrays only
  std::string str;                     // kString
  std::vector<std::string> strings;    // array of strings
  std::vector<std::uint8_t> raw;       // scalars, arrays of scalars
};

namespace {

void set_error(std::string* error, const std::string& msg) {
  if (error != nullptr) *error = msg;
}

// Size in bytes of a scalar value type; 0 for string/array.
std::size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::kUint8:
    case ValueType::kInt8:
    case ValueType::kBool: return 1;
    case ValueType::kUint16:
    case ValueType::kInt16: return 2;
    case ValueType::kUint32:
    case ValueType::kInt32:
    case ValueType::kFloat32: return 4;
    case ValueType::kUint64:
    case ValueType::kInt64:
    case ValueType::kFloat64: return 8;
    default: return 0;
  }
}

bool known_value_type(std::uint32_t t) {
  return t <= static_cast<std::uint32_t>(ValueType::kFloat64);
}

const char* value_type_name(ValueType t) {
  static const char* const kNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                       "int32",  "float32", "bool",   "string", "array",
                                       "uint64", "int64",   "float64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < 13 ? kNames[i] : "unknown";
}

// Bounds-checked cursor over the mapping.
class Cursor {
 public:
  Cursor(const std::uint8_t* p, std::uint64_t size) : p_(p), size_(size) {}
  std::uint64_t pos() const { return pos_; }
  bool read(void* dst, std::uint64_t n) {
    if (n > size_ - pos_) return false;
    std::memcpy(dst, p_ + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool get(T* v) {
    return read(v, sizeof(T));
  }
  bool skip(std::uint64_t n) {
    if (n > size_ - pos_) return false;
    pos_ += n;
    return true;
  }
  // A GGUF string; `max` bounds its length.
  bool string(std::string* s, std::uint64_t max = std::uint64_t{1} << 20) {
    std::uint64_t n = 0;
    if (!get(&n) || n > max || n > size_ - pos_) return false;
    s->assign(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return true;
  }

 private:
  const std::uint8_t* p_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
};

bool integer_value(const std::uint8_t* raw, ValueType t, std::int64_t* out_i, std::uint64_t* out_u,
                   bool* is_signed) {
  switch (t) {
    case ValueType::kUint8:
      *out_u = raw[0];
      *is_signed = false;
      return true;
    case ValueType::kInt8:
      *out_i = static_cast<std::int8_t>(raw[0]);
      *is_signed = true;
      return true;
    case ValueType::kUint16: {
      std::uint16_t v;
      std::memcpy(&v, raw, 2);
      *out_u = v;
      *is_signed = false;
      return true;
    }
    case ValueType::kInt16: {
      std::int16_t v;
      std::memcpy(&v, raw, 2);
      *out_i = v;
      *is_signed = true;
      return true;
    }
    case ValueType::kUint32: {
      std::uint32_t v;
      std::memcpy(&v, raw, 4);
      *out_u = v;
      *is_signed = false;
      return true;
    }
    case ValueType::kInt32: {
      std::int32_t v;
      std::memcpy(&v, raw, 4);
      *out_i = v;
      *is_signed = true;
      return true;
    }
    case ValueType::kUint64: {
      std::uint64_t v;
      std::memcpy(&v, raw, 8);
      *out_u = v;
      *is_signed = false;
      return true;
    }
    case ValueType::kInt64: {
      std::int64_t v;
      std::memcpy(&v, raw, 8);
      *out_i = v;
      *is_signed = true;
      return true;
    }
    default: return false;
  }
}

}  // namespace

int block_elements(TensorType type) {
  switch (type) {
    case TensorType::kF32:
    case TensorType::kF16: return 1;
    case TensorType::kQ4_1:
    case TensorType::kQ8_0: return 32;
  }
  return 0;
}

int block_bytes(TensorType type) {
  switch (type) {
    case TensorType::kF32: return 4;
    case TensorType::kF16: return 2;
    case TensorType::kQ4_1: return 20;
    case TensorType::kQ8_0: return 34;
  }
  return 0;
}

const char* type_name(TensorType type) {
  switch (type) {
    case TensorType::kF32: return "F32";
    case TensorType::kF16: return "F16";
    case TensorType::kQ4_1: return "Q4_1";
    case TensorType::kQ8_0: return "Q8_0";
  }
  return "unknown";
}

std::uint64_t TensorInfo::row_bytes() const {
  return ne[0] / static_cast<std::uint64_t>(block_elements(type)) *
         static_cast<std::uint64_t>(block_bytes(type));
}

File::~File() {
  if (map_ != nullptr) munmap(const_cast<std::uint8_t*>(map_), static_cast<std::size_t>(size_));
}

std::unique_ptr<File> File::open(const std::string& path, std::string* error) {
  const std::string where = "gguf '" + path + "'";
  auto fail = [&](const std::string& why) -> std::unique_ptr<File> {
    set_error(error, where + ": " + why);
    return nullptr;
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail("not a regular file");
  }
  std::unique_ptr<File> f(new File());
  f->path_ = path;
  f->size_ = static_cast<std::uint64_t>(st.st_size);
  if (f->size_ < 24) {
    ::close(fd);
    return fail("file of " + std::to_string(f->size_) +
                " bytes is too small for a GGUF header (24)");
  }
  void* m = mmap(nullptr, static_cast<std::size_t>(f->size_), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return fail(std::string("mmap failed: ") + std::strerror(errno));
  f->map_ = static_cast<const std::uint8_t*>(m);

  Cursor c(f->map_, f->size_);
  char magic[4];
  c.read(magic, 4);
  if (std::memcmp(magic, "GGUF", 4) != 0) return fail("bad magic (not a GGUF file)");
  c.get(&f->version_);
  if (f->version_ != 2 && f->version_ != 3)
    return fail("unsupported version " + std::to_string(f->version_) + " (2 and 3 are)");
  std::uint64_t n_tensors = 0, n_kv = 0;
  c.get(&n_tensors);
  c.get(&n_kv);
  // Each key-value takes at least 13 bytes and each tensor at least 24.
  if (n_kv > f->size_ / 13)
    return fail("metadata count " + std::to_string(n_kv) + " exceeds the file");
  if (n_tensors > f->size_ / 24)
    return fail("tensor count " + std::to_string(n_tensors) + " exceeds the file");

  for (std::uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    if (!c.string(&key, 1 << 16))
      return fail("metadata entry " + std::to_string(i) + ": key truncated or too long");
    std::uint32_t t = 0;
    if (!c.get(&t)) return fail("metadata '" + key + "': type truncated");
    if (!known_value_type(t))
      return fail("metadata '" + key + "': unknown type " + std::to_string(t));
    auto v = std::make_unique<Value>();
    v->type = static_cast<ValueType>(t);
    if (v->type == ValueType::kString) {
      if (!c.string(&v->str, f->size_)) return fail("metadata '" + key + "': string truncated");
    } else if (v->type == ValueType::kArray) {
      std::uint32_t et = 0;
      if (!c.get(&et) || !c.get(&v->count))
        return fail("metadata '" + key + "': array header truncated");
      if (!known_value_type(et) || et == static_cast<std::uint32_t>(ValueType::kArray))
        return fail("metadata '" + key + "': unsupported array element type " + std::to_string(et));
      v->elem = static_cast<ValueType>(et);
      if (v->elem == ValueType::kString) {
        if (v->count > (f->size_ - c.pos()) / 8)
          return fail("metadata '" + key + "': array truncated");
        v->strings.resize(static_cast<std::size_t>(v->count));
        for (auto& s : v->strings)
          if (!c.string(&s, f->size_))
            return fail("metadata '" + key + "': array string truncated");
      } else {
        const std::uint64_t es = scalar_size(v->elem);
        if (v->count > (f->size_ - c.pos()) / es)
          return fail("metadata '" + key + "': array truncated");
        v->raw.resize(static_cast<std::size_t>(v->count * es));
        c.read(v->raw.data(), v->raw.size());
      }
    } else {
      v->raw.resize(scalar_size(v->type));
      if (!c.read(v->raw.data(), v->raw.size()))
        return fail("metadata '" + key + "': value truncated");
    }
    if (f->find(key) != nullptr) return fail("metadata key '" + key + "' appears twice");
    f->kv_.emplace_back(std::move(key), std::move(v));
  }

  std::uint64_t alignment = 32;
  if (f->has("general.alignment")) {
    std::uint32_t a = 0;
    std::string e;
    if (!f->get_u32("general.alignment", &a, &e)) return fail(e);
    if (a == 0 || (a & (a - 1)) != 0 || a > 4096)
      return fail("general.alignment " + std::to_string(a) + " is not a power of two <= 4096");
    alignment = a;
  }

  f->tensors_.resize(static_cast<std::size_t>(n_tensors));
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo& t = f->tensors_[static_cast<std::size_t>(i)];
    if (!c.string(&t.name, 1 << 16))
      return fail("tensor " + std::to_string(i) + ": name truncated or too long");
    const std::string tw = "tensor '" + t.name + "': ";
    std::uint32_t nd = 0;
    if (!c.get(&nd)) return fail(tw + "rank truncated");
    if (nd < 1 || nd > 4) return fail(tw + "rank " + std::to_string(nd) + " outside 1..4");
    t.n_dims = static_cast<int>(nd);
    std::uint64_t n_el = 1;
    for (std::uint32_t d = 0; d < nd; ++d) {
      if (!c.get(&t.ne[d])) return fail(tw + "shape truncated");
      if (t.ne[d] == 0) return fail(tw + "dimension " + std::to_string(d) + " is 0");
      if (t.ne[d] > (std::uint64_t{1} << 62) / n_el) return fail(tw + "element count overflows");
      n_el *= t.ne[d];
    }
    std::uint32_t ty = 0;
    if (!c.get(&ty)) return fail(tw + "type truncated");
    if (ty != 0 && ty != 1 && ty != 3 && ty != 8)
      return fail(tw + "unsupported tensor type " + std::to_string(ty) +
                  " (F32, F16, Q4_1, Q8_0 are)");
    t.type = static_cast<TensorType>(ty);
    if (t.ne[0] % static_cast<std::uint64_t>(block_elements(t.type)) != 0)
      return fail(tw + "ne[0] " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                  type_name(t.type) + " block (" + std::to_string(block_elements(t.type)) + ")");
    if (!c.get(&t.offset)) return fail(tw + "offset truncated");
    if (t.offset % alignment != 0)
      return fail(tw + "offset " + std::to_string(t.offset) + " is not aligned to " +
                  std::to_string(alignment));
    t.n_bytes = n_el / static_cast<std::uint64_t>(block_elements(t.type)) *
                static_cast<std::uint64_t>(block_bytes(t.type));
    if (f->tensor(t.name) != &t) return fail("tensor name '" + t.name + "' appears twice");
  }

  const std::uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  if (data_start > f->size_) return fail("data section starts past the end of the file");
  std::vector<std::pair<std::uint64_t, std::size_t>> order;
  for (std::size_t i = 0; i < f->tensors_.size(); ++i) {
    TensorInfo& t = f->tensors_[i];
    const std::uint64_t avail = f->size_ - data_start;
    if (t.offset > avail || t.n_bytes > avail - t.offset) {
      std::ostringstream os;
      os << "tensor '" << t.name << "': data [" << t.offset << ", " << t.offset + t.n_bytes
         << ") of the data section ends past the end of the file (" << f->size_
         << " bytes; file truncated?)";
      return fail(os.str());
    }
    t.data = f->map_ + data_start + t.offset;
    order.emplace_back(t.offset, i);
  }
  std::sort(order.begin(), order.end());
  for (std::size_t i = 1; i < order.size(); ++i) {
    const TensorInfo& a = f->tensors_[order[i - 1].second];
    const TensorInfo& b = f->tensors_[order[i].second];
    if (a.offset + a.n_bytes > b.offset)
      return fail("tensors '" + a.name + "' and '" + b.name + "' overlap");
  }
  return f;
}

const File::Value* File::find(const std::string& key) const {
  for (const auto& kv : kv_)
    if (kv.first == key) return kv.second.get();
  return nullptr;
}

bool File::has(const std::string& key) const { return find(key) != nullptr; }

const TensorInfo* File::tensor(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {
std::string missing(const std::string& path, const std::string& key) {
  return "gguf '" + path + "': metadata '" + key + "' is missing";
}
std::string wrong_type(const std::string& path, const std::string& key, ValueType got,
                       const char* want) {
  return "gguf '" + path + "': metadata '" + key + "' has type " + value_type_name(got) +
         ", expected " + want;
}
}  // namespace

bool File::get_u32(const std::string& key, std::uint32_t* out, std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  std::int64_t i = 0;
  std::uint64_t u = 0;
  bool is_signed = false;
  if (v->type == ValueType::kString || v->type == ValueType::kArray ||
      !integer_value(v->raw.data(), v->type, &i, &u, &is_signed))
    return set_error(error, wrong_type(path_, key, v->type, "an integer")), false;
  if (is_signed) {
    if (i < 0)
      return set_error(error, "gguf '" + path_ + "': metadata '" + key + "' is negative"), false;
    u = static_cast<std::uint64_t>(i);
  }
  if (u > std::numeric_limits<std::uint32_t>::max())
    return set_error(error, "gguf '" + path_ + "': metadata '" + key + "' exceeds uint32"), false;
  *out = static_cast<std::uint32_t>(u);
  return true;
}

bool File::get_f32(const std::string& key, float* out, std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  if (v->type == ValueType::kFloat32) {
    std::memcpy(out, v->raw.data(), 4);
  } else if (v->type == ValueType::kFloat64) {
    double d;
    std::memcpy(&d, v->raw.data(), 8);
    *out = static_cast<float>(d);
  } else {
    return set_error(error, wrong_type(path_, key, v->type, "float32")), false;
  }
  return true;
}

bool File::get_bool(const std::string& key, bool* out, std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  if (v->type != ValueType::kBool)
    return set_error(error, wrong_type(path_, key, v->type, "bool")), false;
  *out = v->raw[0] != 0;
  return true;
}

bool File::get_string(const std::string& key, std::string* out, std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  if (v->type != ValueType::kString)
    return set_error(error, wrong_type(path_, key, v->type, "string")), false;
  *out = v->str;
  return true;
}

bool File::get_string_array(const std::string& key, std::vector<std::string>* out,
                            std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  if (v->type != ValueType::kArray || v->elem != ValueType::kString)
    return set_error(error, wrong_type(path_, key, v->type, "array of string")), false;
  *out = v->strings;
  return true;
}

bool File::get_i32_array(const std::string& key, std::vector<std::int32_t>* out,
                         std::string* error) const {
  const Value* v = find(key);
  if (v == nullptr) return set_error(error, missing(path_, key)), false;
  if (v->type != ValueType::kArray || v->elem != ValueType::kInt32)
    return set_error(error, wrong_type(path_, key, v->type, "array of int32")), false;
  out->resize(static_cast<std::size_t>(v->count));
  if (!out->empty()) std::memcpy(out->data(), v->raw.data(), v->raw.size());
  return true;
}

const TensorInfo* File::expect(const std::string& name, std::uint64_t ne0, std::uint64_t ne1,
                               const std::vector<TensorType>& types, std::string* error) const {
  const TensorInfo* t = tensor(name);
  const std::string tw = "gguf '" + path_ + "': tensor '" + name + "'";
  if (t == nullptr) return set_error(error, tw + " is missing"), nullptr;
  const std::uint64_t got1 = t->ne[1] * t->ne[2] * t->ne[3];
  if (t->ne[0] != ne0 || got1 != ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
    std::ostringstream os;
    os << tw << ": shape [" << t->ne[0];
    for (int d = 1; d < t->n_dims; ++d) os << ", " << t->ne[d];
    os << "], expected [" << ne0;
    if (ne1 != 1) os << ", " << ne1;
    os << "]";
    return set_error(error, os.str()), nullptr;
  }
  if (std::find(types.begin(), types.end(), t->type) == types.end()) {
    std::string list;
    for (TensorType ty : types) list += std::string(list.empty() ? "" : " or ") + type_name(ty);
    return set_error(error, tw + ": type " + type_name(t->type) + ", expected " + list), nullptr;
  }
  return t;
}

bool has_magic(const std::string& path) {
  char magic[4] = {};
  std::ifstream f(path, std::ios::binary);
  return f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

void dequantize_row(const TensorInfo& t, std::uint64_t row, float* out) {
  const std::uint8_t* p = t.data + row * t.row_bytes();
  const std::uint64_t n = t.ne[0];
  if (t.type == TensorType::kF16) {
    for (std::uint64_t j = 0; j < n; ++j) {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * j, 2);
      out[j] = codec::f16_to_f32(h);
    }
    return;
  }
  // The runner's own dequantization (models/qmatmul.h), in one-row pieces of
  // at most 2^20 elements (a multiple of the block) so that int columns hold.
  const WeightType wt = t.type == TensorType::kF32    ? WeightType::kF32
                        : t.type == TensorType::kQ4_1 ? WeightType::kQ4_1
                                                      : WeightType::kQ8_0;
  const std::uint64_t per_block = static_cast<std::uint64_t>(block_elements(t.type)),
                      bytes = static_cast<std::uint64_t>(block_bytes(t.type));
  constexpr std::uint64_t kPiece = std::uint64_t{1} << 20;
  for (std::uint64_t j = 0; j < n; j += kPiece) {
    const std::uint64_t len = n - j < kPiece ? n - j : kPiece;
    const WeightMatrix piece{wt, 1, static_cast<int>(len), p + j / per_block * bytes};
    model::dequantize_row(piece, 0, out + j);
  }
}

}  // namespace kvxfer::model::gguf
