// safetensors reader, writer and sharded checkpoints. Malformed files are assembled by
// hand (length + header text + data) so each case shows exactly what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "testing.h"

namespace keel {
namespace {

using testing::TempDir;
using testing::read_file;
using testing::write_file;

std::vector<std::byte> bytes_of(std::initializer_list<uint8_t> values) {
  std::vector<std::byte> out;
  for (uint8_t v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

// A file image: u64 little-endian `length` (by default the header's size), the header
// text, then `data`.
std::vector<std::byte> image(const std::string& header, const std::vector<std::byte>& data = {},
                             std::optional<uint64_t> length = std::nullopt) {
  std::vector<std::byte> out;
  uint64_t n = length.value_or(header.size());
  for (int i = 0; i < 8; ++i, n >>= 8) out.push_back(static_cast<std::byte>(n & 0xff));
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<std::byte> zeros(size_t n) { return std::vector<std::byte>(n); }

// A valid file of U8 [1] tensors; the i-th (in `names` order) is the byte i + 1.
std::vector<std::byte> u8_tensors(const std::vector<std::string>& names) {
  std::string header = "{";
  std::vector<std::byte> data;
  for (size_t i = 0; i < names.size(); ++i) {
    header += (i ? "," : "") + std::string("\"") + names[i] + R"(":{"dtype":"U8","shape":[1],"data_offsets":[)" +
              std::to_string(i) + "," + std::to_string(i + 1) + "]}";
    data.push_back(static_cast<std::byte>(i + 1));
  }
  return image(header + "}", data);
}

SafetensorsHeader parse(const std::vector<std::byte>& file) { return parse_safetensors(file, "bad.safetensors"); }

std::vector<std::byte> view_bytes(const TensorView& v) { return {v.bytes().begin(), v.bytes().end()}; }

// ---- round trip ----------------------------------------------------------------------

TEST(SafetensorsWriter, RoundTripsDtypesEmptyTensorAndMetadata) {
  TempDir dir("st-roundtrip");
  const std::string path = dir.file("model.safetensors");
  const float f32_values[6] = {1, 2, 3, 4, 5, 6};
  std::vector<std::byte> f32(24);
  std::memcpy(f32.data(), f32_values, 24);
  const auto bf16 = bytes_of({0x80, 0x3f, 0x00, 0x40, 0x40, 0x40, 0x80, 0xbf});  // 1, 2, 3, -1
  const auto e8m0 = bytes_of({0x7f, 0x80, 0x00});
  const auto i8 = bytes_of({0xff, 0x00, 0x7f, 0x80, 0x01});
  const auto f4 = bytes_of({0x21, 0x43, 0x65});  // 6 packed e2m1 values

  SafetensorsWriter w;
  w.add("w.f32", DType::f32, {2, 3}, [&](std::span<std::byte> out) {
    ASSERT_EQ(out.size(), 24u);
    std::ranges::copy(f32, out.begin());
  });
  w.add_bytes("w.bf16", DType::bf16, {4}, bf16);
  w.add_bytes("scale", DType::f8_e8m0, {3}, e8m0);
  w.add_bytes("ids", DType::i8, {5}, i8);
  w.add_bytes("empty", DType::i64, {0, 4}, {});
  w.add_bytes("fp4", DType::f4_e2m1, {2, 3}, f4);
  w.set_metadata("format", "pt");
  w.set_metadata("note", "round trip");
  EXPECT_EQ(w.data_bytes(), 43u);
  w.write(path);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  // The raw file: padded header, then the data in declaration order.
  const auto raw = read_file(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | std::to_integer<uint64_t>(raw[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  ASSERT_EQ(raw.size(), 8 + n + 43);
  const std::string text(reinterpret_cast<const char*>(raw.data()) + 8, n);
  EXPECT_EQ(text.find_last_not_of(' '), text.rfind('}'));
  const auto header = nlohmann::json::parse(text);
  EXPECT_EQ(header["__metadata__"], nlohmann::json({{"format", "pt"}, {"note", "round trip"}}));
  EXPECT_EQ(header["w.f32"], nlohmann::json::parse(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})"));
  EXPECT_EQ(header["w.bf16"], nlohmann::json::parse(R"({"dtype":"BF16","shape":[4],"data_offsets":[24,32]})"));
  EXPECT_EQ(header["scale"], nlohmann::json::parse(R"({"dtype":"F8_E8M0","shape":[3],"data_offsets":[32,35]})"));
  EXPECT_EQ(header["ids"], nlohmann::json::parse(R"({"dtype":"I8","shape":[5],"data_offsets":[35,40]})"));
  EXPECT_EQ(header["empty"], nlohmann::json::parse(R"({"dtype":"I64","shape":[0,4],"data_offsets":[40,40]})"));
  EXPECT_EQ(header["fp4"], nlohmann::json::parse(R"({"dtype":"F4","shape":[2,3],"data_offsets":[40,43]})"));
  std::vector<std::byte> data;
  for (const auto& part : {f32, bf16, e8m0, i8, f4}) data.insert(data.end(), part.begin(), part.end());
  EXPECT_EQ(std::vector<std::byte>(raw.begin() + 8 + static_cast<ptrdiff_t>(n), raw.end()), data);

  // Read back through the reader.
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.header().data_start, 8 + n);
  EXPECT_EQ(file.header().metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"note", "round trip"}}));
  std::vector<std::string> order;
  for (const auto& e : file.header().tensors) order.push_back(e.name);
  EXPECT_EQ(order, (std::vector<std::string>{"w.f32", "w.bf16", "scale", "ids", "empty", "fp4"}));
  const struct {
    const char* name;
    DType dtype;
    Shape shape;
    const std::vector<std::byte>* bytes;
  } expected[] = {{"w.f32", DType::f32, {2, 3}, &f32},     {"w.bf16", DType::bf16, {4}, &bf16},
                  {"scale", DType::f8_e8m0, {3}, &e8m0},  {"ids", DType::i8, {5}, &i8},
                  {"fp4", DType::f4_e2m1, {2, 3}, &f4}};
  for (const auto& x : expected) {
    SCOPED_TRACE(x.name);
    const TensorEntry* e = file.find(x.name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, x.dtype);
    EXPECT_EQ(e->shape, x.shape);
    const TensorView v = file.view(*e);
    EXPECT_EQ(v.memory, Memory::mapped);
    EXPECT_EQ(view_bytes(v), *x.bytes);
  }
  const TensorEntry* empty = file.find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->shape, (Shape{0, 4}));
  EXPECT_EQ(empty->begin, empty->end);
  EXPECT_EQ(file.find("absent"), nullptr);
}

TEST(SafetensorsWriter, FillsEachTensorOnceInDeclarationOrder) {
  TempDir dir("st-fill-order");
  std::vector<std::pair<std::string, size_t>> calls;
  SafetensorsWriter w;
  for (const auto& [name, n] : {std::pair{"b", 3}, {"a", 1}, {"c", 2}})
    w.add(name, DType::u8, {n}, [&calls, name = std::string(name)](std::span<std::byte> out) {
      calls.emplace_back(name, out.size());
    });
  w.write(dir.file("x.safetensors"));
  EXPECT_EQ(calls, (std::vector<std::pair<std::string, size_t>>{{"b", 3}, {"a", 1}, {"c", 2}}));
}

TEST(SafetensorsWriter, AddBytesRejectsAWrongSize) {
  SafetensorsWriter w;
  const auto msg = KEEL_EXPECT_ERROR(w.add_bytes("t", DType::f32, {2, 3}, zeros(20)), ErrorCode::byte_size_mismatch);
  EXPECT_NE(msg.find("tensor 't'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape [2, 3] x F32 needs 24 bytes, got 20"), std::string::npos) << msg;
}

TEST(SafetensorsWriter, RejectsUnusableDeclarations) {
  SafetensorsWriter w;
  const auto noop = [](std::span<std::byte>) {};
  KEEL_EXPECT_ERROR(w.add("odd", DType::f4_e2m1, {3}, noop), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.add("neg", DType::f32, {2, -1}, noop), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.add("__metadata__", DType::f32, {1}, noop), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.add("", DType::f32, {1}, noop), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.add("bad\xff", DType::f32, {1}, noop), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.set_metadata("k", "bad\xff"), ErrorCode::usage);
  KEEL_EXPECT_ERROR(w.add("nofill", DType::f32, {1}, nullptr), ErrorCode::usage);
  w.add("t", DType::f32, {1}, noop);
  const auto msg = KEEL_EXPECT_ERROR(w.add("t", DType::f32, {1}, noop), ErrorCode::duplicate_tensor);
  EXPECT_NE(msg.find("tensor 't'"), std::string::npos) << msg;
  EXPECT_EQ(w.entries().size(), 1u);
  EXPECT_EQ(w.data_bytes(), 4u);
}

TEST(SafetensorsWriter, FailedFillKeepsTheOldFileAndRemovesTheTemporary) {
  TempDir dir("st-fail");
  const std::string path = dir.file("model.safetensors");
  write_file(path, std::string("old contents"));
  SafetensorsWriter w;
  w.add_bytes("fine", DType::u8, {2}, bytes_of({1, 2}));
  w.add("broken", DType::u8, {2}, [](std::span<std::byte>) { throw std::runtime_error("generator exploded"); });
  const auto msg = KEEL_EXPECT_ERROR(w.write(path), ErrorCode::io);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'broken'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("generator exploded"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const auto old = read_file(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(old.data()), old.size()), "old contents");
}

TEST(SafetensorsWriter, UnwritablePathIsAnIoErrorNamingIt) {
  TempDir dir("st-unwritable");
  const std::string path = dir.file("no/such/dir/model.safetensors");
  SafetensorsWriter w;
  w.add_bytes("t", DType::u8, {1}, bytes_of({1}));
  const auto msg = KEEL_EXPECT_ERROR(w.write(path), ErrorCode::io);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// ---- the reader: valid files -----------------------------------------------------------

TEST(SafetensorsParse, SortsByBeginAndReadsMetadata) {
  const std::string header =
      R"({"z":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},"__metadata__":{"format":"pt"}})";
  const auto h = parse(image(header, zeros(3)));
  EXPECT_EQ(h.data_start, 8 + header.size());
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "z");
  EXPECT_EQ(h.tensors[1].name, "a");
  EXPECT_EQ(h.tensors[1].begin, 2u);
  EXPECT_EQ(h.tensors[1].end, 3u);
  EXPECT_EQ(h.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
}

TEST(SafetensorsParse, AcceptsAnEmptyHeader) {
  const auto h = parse(image("{}"));
  EXPECT_TRUE(h.tensors.empty());
  EXPECT_EQ(h.data_start, 10u);
}

TEST(SafetensorsParse, EmptyTensorsOverlapNothing) {
  const auto h = parse(image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}})",
                             zeros(4)));
  EXPECT_EQ(h.tensors.size(), 2u);
}

TEST(SafetensorsParse, AcceptsAZeroDimensionBesideLargeOnes) {
  const auto h = parse(image(R"({"e":{"dtype":"F32","shape":[4294967296,0,1073741824],"data_offsets":[0,0]}})"));
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].shape, (Shape{4294967296, 0, 1073741824}));
}

// ---- the reader: malformed files --------------------------------------------------------

TEST(SafetensorsParse, FileShorterThanTheLength) {
  const auto msg = KEEL_EXPECT_ERROR(parse(bytes_of({1, 0, 0, 0, 0})), ErrorCode::file_too_small);
  EXPECT_NE(msg.find("file 'bad.safetensors'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5 bytes"), std::string::npos) << msg;
}

TEST(SafetensorsParse, HeaderLengthPastTheFile) {
  const auto msg = KEEL_EXPECT_ERROR(parse(image("{}", {}, 3)), ErrorCode::header_too_large);
  EXPECT_NE(msg.find("file 'bad.safetensors'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("header length 3 exceeds the 2 bytes"), std::string::npos) << msg;
}

TEST(SafetensorsParse, HeaderLengthPastTheLimit) {
  const auto msg = KEEL_EXPECT_ERROR(parse(image("{}", {}, (100ull << 20) + 1)), ErrorCode::header_too_large);
  EXPECT_NE(msg.find("file 'bad.safetensors'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("104857601"), std::string::npos) << msg;
  EXPECT_NE(msg.find("104857600"), std::string::npos) << msg;
}

TEST(SafetensorsParse, HugeHeaderLengthDoesNotWrap) {
  KEEL_EXPECT_ERROR(parse(image("{}", {}, ~0ull)), ErrorCode::header_too_large);
}

struct BadHeader {
  const char* test_name;
  std::string header;
  size_t data_bytes;
  ErrorCode code;
  std::string tensor;  // must be named when not empty
  std::string says;    // expected vs found
};

class SafetensorsBadHeader : public ::testing::TestWithParam<BadHeader> {};

TEST_P(SafetensorsBadHeader, FailsWithItsCodeNamingFileAndTensor) {
  const BadHeader& c = GetParam();
  const auto msg = KEEL_EXPECT_ERROR(parse(image(c.header, zeros(c.data_bytes))), c.code);
  EXPECT_NE(msg.find("file 'bad.safetensors'"), std::string::npos) << msg;
  if (!c.tensor.empty()) {
    EXPECT_NE(msg.find("tensor '" + c.tensor + "'"), std::string::npos) << msg;
  }
  EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
}

// An entry with one field replaced.
std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"t":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

const BadHeader kBadHeaders[] = {
    {"NotJson", R"({"t": )", 0, ErrorCode::header_json, "", "not well-formed JSON"},
    {"TrailingGarbage", R"({} x)", 0, ErrorCode::header_json, "", "not well-formed JSON"},
    {"InvalidUtf8", "{\"t\xff\": 1}", 0, ErrorCode::header_json, "", "not well-formed JSON"},
    {"NotAnObject", R"([1, 2])", 0, ErrorCode::header_json, "", "expected a JSON object, found an array"},
    {"EntryNotAnObject", R"({"t": 5})", 0, ErrorCode::header_entry, "t", "expected an object, found 5"},
    {"MissingDtype", R"({"t":{"shape":[1],"data_offsets":[0,1]}})", 1, ErrorCode::header_entry, "t",
     "field 'dtype': missing"},
    {"DtypeNotString", entry("7", "[1]", "[0,1]"), 1, ErrorCode::header_entry, "t",
     "field 'dtype': expected a string, found 7"},
    {"MissingShape", R"({"t":{"dtype":"U8","data_offsets":[0,1]}})", 1, ErrorCode::header_entry, "t",
     "field 'shape': missing"},
    {"ShapeNotArray", entry(R"("U8")", "4", "[0,4]"), 4, ErrorCode::header_entry, "t",
     "expected an array of non-negative integers, found 4"},
    {"ShapeNegative", entry(R"("U8")", "[2,-1]", "[0,2]"), 2, ErrorCode::header_entry, "t", "dimension 1 is -1"},
    {"ShapeFloat", entry(R"("U8")", "[2.0]", "[0,2]"), 2, ErrorCode::header_entry, "t", "dimension 0 is 2.0"},
    {"ShapeString", entry(R"("U8")", R"(["2"])", "[0,2]"), 2, ErrorCode::header_entry, "t",
     R"(dimension 0 is "2")"},
    {"ShapePastInt64", entry(R"("U8")", "[9223372036854775808]", "[0,1]"), 1, ErrorCode::header_entry, "t",
     "dimension 0 is 9223372036854775808"},
    {"MissingDataOffsets", R"({"t":{"dtype":"U8","shape":[1]}})", 1, ErrorCode::header_entry, "t",
     "field 'data_offsets': missing"},
    {"DataOffsetsThree", entry(R"("U8")", "[1]", "[0,1,2]"), 2, ErrorCode::header_entry, "t",
     "expected [begin, end], found an array of 3 elements"},
    {"DataOffsetsNotArray", entry(R"("U8")", "[1]", R"({"begin":0})"), 1, ErrorCode::header_entry, "t",
     "expected [begin, end], found an object"},
    {"DataOffsetsNegative", entry(R"("U8")", "[1]", "[-1,0]"), 1, ErrorCode::header_entry, "t",
     "expected two non-negative integers, found [-1, 0]"},
    {"DataOffsetsPastUint64", entry(R"("U8")", "[0]", "[0,18446744073709551616]"), 0, ErrorCode::header_entry,
     "t", "expected two non-negative integers"},
    {"DataOffsetsBeginAfterEnd", entry(R"("U8")", "[0]", "[4,0]"), 4, ErrorCode::header_entry, "t",
     "begin 4 is past end 0"},
    {"MetadataNotObject", R"({"__metadata__": ["pt"]})", 0, ErrorCode::header_entry, "",
     "field '__metadata__': expected an object, found an array"},
    {"MetadataValueNotString", R"({"__metadata__": {"format": 1}})", 0, ErrorCode::header_entry, "",
     "value of 'format' is 1, expected a string"},
    {"UnknownDtype", entry(R"("F7")", "[1]", "[0,1]"), 1, ErrorCode::unknown_dtype, "t",
     R"(unknown dtype "F7"; known: F64, F32)"},
    {"ByteSizeMismatch", entry(R"("F32")", "[2,3]", "[0,20]"), 20, ErrorCode::byte_size_mismatch, "t",
     "shape [2, 3] x F32 needs 24 bytes, data_offsets give 20"},
    {"OddE2m1Count", entry(R"("F4")", "[3]", "[0,2]"), 2, ErrorCode::byte_size_mismatch, "t",
     "shape [3] x F4 is 3 elements of 4 bits, which do not fill whole bytes"},
    {"ElementCountOverflows", entry(R"("U8")", "[4294967296,4294967296]", "[0,0]"), 0,
     ErrorCode::byte_size_mismatch, "t", "multiply past 2^63 - 1"},
    {"EmptyButDimensionsOverflow", entry(R"("U8")", "[0,4611686018427387904,4]", "[0,0]"), 0,
     ErrorCode::byte_size_mismatch, "t", "multiply past 2^63 - 1"},
    {"BitCountOverflows", entry(R"("F64")", "[4611686018427387904]", "[0,0]"), 0, ErrorCode::byte_size_mismatch,
     "t", "its size in bits passes 2^64"},
    {"OutOfBounds", entry(R"("U8")", "[4]", "[0,4]"), 3, ErrorCode::out_of_bounds, "t",
     "data_offsets [0, 4] end past the data section, which holds 3 bytes"},
    {"Overlap",
     R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
     6, ErrorCode::overlap, "b", "bytes [2, 6) overlap tensor 'a' at [0, 4)"},
    {"DuplicateTensor",
     R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
     2, ErrorCode::duplicate_tensor, "t", "appears twice"},
    {"DuplicateField", R"({"t":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", 1,
     ErrorCode::header_entry, "t", "field 'dtype': key appears twice"},
};

INSTANTIATE_TEST_SUITE_P(Cases, SafetensorsBadHeader, ::testing::ValuesIn(kBadHeaders),
                         [](const auto& info) { return std::string(info.param.test_name); });

// ---- SafetensorsFile -----------------------------------------------------------------

TEST(SafetensorsFile, ErrorsNameThePathOnDisk) {
  TempDir dir("st-file");
  const std::string path = dir.file("broken.safetensors");
  write_file(path, image(entry(R"("F32")", "[2,3]", "[0,20]"), zeros(20)));
  const auto msg = KEEL_EXPECT_ERROR(SafetensorsFile::open(path), ErrorCode::byte_size_mismatch);
  EXPECT_NE(msg.find("file '" + path + "'"), std::string::npos) << msg;
}

TEST(SafetensorsFile, MissingFileIsAnIoError) {
  TempDir dir("st-missing");
  const std::string path = dir.file("absent.safetensors");
  const auto msg = KEEL_EXPECT_ERROR(SafetensorsFile::open(path), ErrorCode::io);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// ---- Checkpoint ----------------------------------------------------------------------

// Two shards: s1 holds a (byte 1) and b (byte 2), s2 holds c (byte 1).
struct TwoShards {
  TempDir dir{"st-shards"};
  std::string s1 = dir.file("model-00001-of-00002.safetensors");
  std::string s2 = dir.file("model-00002-of-00002.safetensors");
  std::string index = dir.file("model.safetensors.index.json");
  TwoShards() {
    write_file(s1, u8_tensors({"a", "b"}));
    write_file(s2, u8_tensors({"c"}));
  }
  void write_index(const std::string& weight_map) {
    write_file(index, R"({"metadata": {"total_size": 3}, "weight_map": )" + weight_map + "}");
  }
};

const std::string kShard1 = "model-00001-of-00002.safetensors";
const std::string kShard2 = "model-00002-of-00002.safetensors";

TEST(Checkpoint, OpensAValidTwoShardIndex) {
  TwoShards t;
  write_safetensors_index(t.dir.path().string(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}}, 3);
  const auto raw = read_file(t.index);
  const auto index = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(raw.data()), raw.size()));
  EXPECT_EQ(index, nlohmann::json::parse(R"({"metadata": {"total_size": 3}, "weight_map": {)"
                                         R"("a": "model-00001-of-00002.safetensors",)"
                                         R"("b": "model-00001-of-00002.safetensors",)"
                                         R"("c": "model-00002-of-00002.safetensors"}})"));

  const auto c = Checkpoint::open(t.dir.path().string());
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(c.file_of("b"), t.s1);
  EXPECT_EQ(c.file_of("c"), t.s2);
  EXPECT_TRUE(c.contains("c"));
  ASSERT_NE(c.find("c"), nullptr);
  EXPECT_EQ(c.find("c")->shape, (Shape{1}));
  EXPECT_EQ(view_bytes(c.view("b")), bytes_of({2}));
  EXPECT_EQ(view_bytes(c.view("c")), bytes_of({1}));
  EXPECT_EQ(c.view("c").memory, Memory::mapped);
}

TEST(Checkpoint, IndexNamesATensorItsShardLacks) {
  TwoShards t;
  t.write_index(R"({"a": ")" + kShard1 + R"(", "b": ")" + kShard1 + R"(", "c": ")" + kShard2 + R"(", "d": ")" +
                kShard1 + R"("})");
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(t.dir.path().string()), ErrorCode::index_mismatch);
  EXPECT_NE(msg.find("tensor 'd'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("file '" + t.s1 + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
}

TEST(Checkpoint, IndexNamesTheWrongShard) {
  TwoShards t;
  t.write_index(R"({"a": ")" + kShard2 + R"(", "b": ")" + kShard1 + R"(", "c": ")" + kShard2 + R"("})");
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(t.dir.path().string()), ErrorCode::index_mismatch);
  EXPECT_NE(msg.find("tensor 'a'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(t.s1), std::string::npos) << msg;
  EXPECT_NE(msg.find(t.s2), std::string::npos) << msg;
}

TEST(Checkpoint, ShardHoldsAnUnlistedTensor) {
  TwoShards t;
  t.write_index(R"({"a": ")" + kShard1 + R"(", "c": ")" + kShard2 + R"("})");
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(t.dir.path().string()), ErrorCode::index_mismatch);
  EXPECT_NE(msg.find("tensor 'b'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("file '" + t.s1 + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
}

TEST(Checkpoint, MissingShardFileIsAnIoErrorNamingIt) {
  TwoShards t;
  std::filesystem::remove(t.s2);
  t.write_index(R"({"a": ")" + kShard1 + R"(", "b": ")" + kShard1 + R"(", "c": ")" + kShard2 + R"("})");
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(t.dir.path().string()), ErrorCode::io);
  EXPECT_NE(msg.find("file '" + t.s2 + "'"), std::string::npos) << msg;
}

TEST(Checkpoint, MalformedIndex) {
  const std::string shard = R"(")" + kShard1 + R"(")";
  for (const std::string& text : {std::string(R"({"weight_map": )"), std::string(R"([])"), std::string(R"({})"),
                                  std::string(R"({"weight_map": []})"), std::string(R"({"weight_map": {}})"),
                                  std::string(R"({"weight_map": {"a": 1}})"),
                                  std::string(R"({"weight_map": {"a": "../elsewhere.safetensors"}})"),
                                  std::string(R"({"metadata": 3, "weight_map": {"a": )" + shard + "}}"),
                                  std::string(R"({"weight_map": {"a": )" + shard + R"(, "a": )" + shard + "}}")}) {
    SCOPED_TRACE(text);
    TwoShards t;
    write_file(t.index, text);
    const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(t.dir.path().string()), ErrorCode::index_json);
    EXPECT_NE(msg.find("file '" + t.index + "'"), std::string::npos) << msg;
  }
}

TEST(Checkpoint, OpensEveryFileWithoutAnIndex) {
  TempDir dir("st-noindex");
  write_file(dir.file("b.safetensors"), u8_tensors({"y"}));
  write_file(dir.file("a.safetensors"), u8_tensors({"x", "z"}));
  write_file(dir.file("notes.txt"), std::string("not a checkpoint"));
  const auto c = Checkpoint::open(dir.path().string());
  EXPECT_EQ(c.names(), (std::vector<std::string>{"x", "y", "z"}));
  ASSERT_EQ(c.files().size(), 2u);
  EXPECT_EQ(c.files()[0].path(), dir.file("a.safetensors"));
  EXPECT_EQ(c.file_of("y"), dir.file("b.safetensors"));
  EXPECT_EQ(view_bytes(c.view("z")), bytes_of({2}));
}

TEST(Checkpoint, DuplicateAcrossFilesWithoutAnIndex) {
  TempDir dir("st-dup");
  write_file(dir.file("a.safetensors"), u8_tensors({"x"}));
  write_file(dir.file("b.safetensors"), u8_tensors({"y", "x"}));
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(dir.path().string()), ErrorCode::duplicate_tensor);
  EXPECT_NE(msg.find("tensor 'x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("a.safetensors")), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("b.safetensors")), std::string::npos) << msg;
}

TEST(Checkpoint, DirectoryWithoutSafetensorsIsAnIoErrorNamingIt) {
  TempDir dir("st-nofiles");
  write_file(dir.file("config.json"), std::string("{}"));
  const auto msg = KEEL_EXPECT_ERROR(Checkpoint::open(dir.path().string()), ErrorCode::io);
  EXPECT_NE(msg.find("file '" + dir.path().string() + "'"), std::string::npos) << msg;
  const std::string absent = dir.file("absent");
  const auto msg2 = KEEL_EXPECT_ERROR(Checkpoint::open(absent), ErrorCode::io);
  EXPECT_NE(msg2.find(absent), std::string::npos) << msg2;
}

TEST(Checkpoint, AbsentTensorIsMissingTensorNamingTheDirectory) {
  TempDir dir("st-absent");
  write_file(dir.file("model.safetensors"), u8_tensors({"x"}));
  const auto c = Checkpoint::open(dir.path().string());
  EXPECT_FALSE(c.contains("w"));
  EXPECT_EQ(c.find("w"), nullptr);
  const auto msg = KEEL_EXPECT_ERROR(c.view("w"), ErrorCode::missing_tensor);
  EXPECT_NE(msg.find("file '" + dir.path().string() + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'w'"), std::string::npos) << msg;
  KEEL_EXPECT_ERROR(c.file_of("w"), ErrorCode::missing_tensor);
}

}  // namespace
}  // namespace keel
