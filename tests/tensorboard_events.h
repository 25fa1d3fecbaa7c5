// Reads a run's TensorBoard event file back without TensorFlow: a minimal protocol-buffer
// reader for the Event and Summary records llmtrain writes, every record's CRCs checked.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>

#include "catch_compat.h"
#include "train/tensorboard.h"

namespace llmtrain::test {


// A minimal protocol-buffer reader: varints, fixed64/32 and length-delimited fields.
struct Reader {
  std::string_view data;
  std::size_t at = 0;
  bool done() const { return at >= data.size(); }
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(data.at(at++));
      v |= std::uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, data.substr(at, sizeof(T)).data(), sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const auto n = std::size_t(varint());
    const auto out = data.substr(at, n);
    at += n;
    return out;
  }
};

// The scalars of a run's TensorBoard file, decoded here (every record's CRCs checked):
// tag -> step -> value, with the number of records and the file version.
struct Events {
  std::map<std::string, std::map<std::int64_t, float>> scalars;
  int records = 0;
  std::string version;
};

inline Events read_events(const std::string& run) {
  Events events;
  std::string file;
  for (const auto& entry : std::filesystem::directory_iterator(run + "/tb")) file = entry.path().string();
  REQUIRE(file.find("events.out.tfevents.") != std::string::npos);
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  for (std::size_t at = 0; at < bytes.size(); ++events.records) {
    REQUIRE(at + 12 <= bytes.size());
    std::uint64_t length;
    std::uint32_t length_crc, data_crc;
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    REQUIRE(length_crc == train::masked_crc32c(std::string_view(bytes).substr(at, 8)));
    const std::string_view data = std::string_view(bytes).substr(at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    REQUIRE(data_crc == train::masked_crc32c(data));
    at += 12 + length + 4;

    Reader event{data};
    std::int64_t step = -1;
    while (!event.done()) {
      const auto key = event.varint();
      if (key == (1 << 3 | 1)) event.fixed<double>();                             // wall_time
      else if (key == (2 << 3 | 0)) step = std::int64_t(event.varint());          // step
      else if (key == (3 << 3 | 2)) events.version = std::string(event.bytes());  // file_version
      else if (key == (5 << 3 | 2)) {                                             // summary
        Reader summary{event.bytes()};
        while (!summary.done()) {
          REQUIRE(summary.varint() == (1 << 3 | 2));  // value
          Reader value{summary.bytes()};
          std::string tag;
          float number = 0;
          while (!value.done()) {
            const auto k = value.varint();
            if (k == (1 << 3 | 2)) tag = std::string(value.bytes());
            else if (k == (2 << 3 | 5)) number = value.fixed<float>();
            else FAIL("unexpected field in Summary.Value");
          }
          events.scalars[tag][step] = number;
        }
      } else {
        FAIL("unexpected field in Event");
      }
    }
  }
  return events;
}

}  // namespace llmtrain::test
