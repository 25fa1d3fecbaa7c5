#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace llmtrain::train {
namespace {

const std::array<std::uint32_t, 256>& crc32c_table() {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reversed Castagnoli polynomial
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protocol-buffer encoding, just what Event and Summary need.
void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, std::uint64_t(field << 3 | wire_type)); }
template <class T>
void put_fixed(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only, like the shard reader
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string event(std::int64_t step, int field, std::string_view payload) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, now_seconds());
  put_key(e, 2, 0);
  put_varint(e, std::uint64_t(step));
  put_bytes(e, field, payload);
  return e;
}

}  // namespace

std::uint32_t crc32c(std::string_view bytes) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const unsigned char b : bytes) c = crc32c_table()[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(std::string_view bytes) {
  const std::uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(now_seconds())) + "." + host;
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) throw RuntimeError(path_ + ": cannot create");
  write_record(event(0, 3, "brain.Event:2"));
}

void TensorBoardWriter::scalar(std::string_view tag, double value, std::int64_t step) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string v;
  put_bytes(v, 1, tag);
  put_key(v, 2, 5);
  put_fixed(v, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, v);
  write_record(event(step, 5, summary));
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string header;
  put_fixed(header, std::uint64_t(data.size()));
  std::string record = header;
  put_fixed(record, masked_crc32c(header));
  record += data;
  put_fixed(record, masked_crc32c(data));
  out_.write(record.data(), std::streamsize(record.size()));
  out_.flush();
  if (!out_) throw RuntimeError(path_ + ": write failed (disk full?)");
}

}  // namespace llmtrain::train
