// TensorBoard event files written directly: the TFRecord framing (length, masked CRC-32C of the
// length, data, masked CRC-32C of the data) around hand-encoded Event protocol buffers holding
// scalar summaries. No TensorFlow or protobuf library is needed to write or to read them.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

namespace llmtrain::train {

/// CRC-32C (Castagnoli), as TFRecord uses it.
std::uint32_t crc32c(std::string_view bytes);
/// TFRecord's masking of a CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t masked_crc32c(std::string_view bytes);

class TensorBoardWriter {
 public:
  /// Creates DIR/events.out.tfevents.<seconds>.<host> and writes the file_version event.
  explicit TensorBoardWriter(const std::string& dir);
  /// One scalar at `step`, flushed at once so a killed run keeps it.
  void scalar(std::string_view tag, double value, std::int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);

  std::string path_;
  std::ofstream out_;
};

}  // namespace llmtrain::train
