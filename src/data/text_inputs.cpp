#include "data/text_inputs.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#if LLMTRAIN_HAVE_ZLIB
#include <zlib.h>
#endif
#if LLMTRAIN_HAVE_ZSTD
#include <zstd.h>
#endif

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::data {
namespace {

constexpr std::size_t raw_chunk = 1 << 17;  // compressed bytes read at a time

enum class Packing { none, gzip, zstd };

// Whether a cut of plain text right before `at` is one GPT-2's pattern makes whatever follows:
// "\n" between printable non-space ASCII characters is a piece of its own, ending the one before.
bool safe_cut(std::string_view text, std::size_t at) {
  const auto printable = [](char c) { return c > ' ' && c < 0x7F; };
  return at >= 2 && at < text.size() && text[at - 1] == '\n' && printable(text[at - 2]) && printable(text[at]);
}

}  // namespace

// The decompressor of one stream: each call of more() appends some decoded bytes, false at the end.
struct TextReader::Decoder {
  Packing packing = Packing::none;
  std::vector<char> in;  // compressed bytes read, [in_pos, in_end) not yet decoded
  std::size_t in_pos = 0, in_end = 0;
  bool raw_ended = false;
  std::uint64_t raw_total = 0;
#if LLMTRAIN_HAVE_ZLIB
  z_stream z{};
  bool z_open = false;
#endif
#if LLMTRAIN_HAVE_ZSTD
  ZSTD_DStream* zstd = nullptr;
  std::size_t left = 1;  // 0 once a frame is whole and flushed
  bool full = false;     // the last call filled the buffer: the decoder may hold more
#endif
  std::vector<char> out;

  ~Decoder() {
#if LLMTRAIN_HAVE_ZLIB
    if (z_open) inflateEnd(&z);
#endif
#if LLMTRAIN_HAVE_ZSTD
    if (zstd) ZSTD_freeDStream(zstd);
#endif
  }
};

TextReader::TextReader(const std::string& path, std::size_t block_bytes, TextFormat stdin_format)
    : name_(path == "-" ? "<stdin>" : path), block_bytes_(std::max<std::size_t>(block_bytes, 1)),
      decoder_(std::make_unique<Decoder>()) {
  std::string name = path;
  if (path == "-") {
    file_ = stdin;
    format_ = stdin_format;
  } else {
    require_regular_file(path, "a text input file");
    file_ = std::fopen(path.c_str(), "rb");
    if (!file_) throw InputError(path + ": cannot open a text input file: " + std::strerror(errno));
    owns_file_ = true;
    if (name.ends_with(".gz")) {
      decoder_->packing = Packing::gzip;
      name.resize(name.size() - 3);
    } else if (name.ends_with(".zst")) {
      decoder_->packing = Packing::zstd;
      name.resize(name.size() - 4);
    }
    format_ = name.ends_with(".jsonl") ? TextFormat::jsonl : TextFormat::text;
  }
  Decoder& d = *decoder_;
  d.in.resize(raw_chunk);
  if (d.packing == Packing::gzip) {
#if LLMTRAIN_HAVE_ZLIB
    if (inflateInit2(&d.z, 16 + MAX_WBITS) != Z_OK) throw RuntimeError("zlib: inflateInit2 failed");
    d.z_open = true;
    d.out.resize(1 << 16);
#else
    throw InputError(path + ": this build reads no gzip input (build it with zlib: zlib1g-dev)");
#endif
  } else if (d.packing == Packing::zstd) {
#if LLMTRAIN_HAVE_ZSTD
    d.zstd = ZSTD_createDStream();
    if (!d.zstd) throw RuntimeError("libzstd: ZSTD_createDStream failed");
    d.out.resize(ZSTD_DStreamOutSize());
#else
    throw InputError(path + ": this build reads no Zstandard input (build it with libzstd: libzstd-dev)");
#endif
  }
}

TextReader::~TextReader() {
  if (owns_file_ && file_) std::fclose(file_);
}

std::size_t TextReader::read_raw(char* into, std::size_t n) {
  const std::size_t got = std::fread(into, 1, n, file_);
  if (got < n && std::ferror(file_)) throw InputError(name_ + ": cannot read: " + std::strerror(errno));
  return got;
}

bool TextReader::fill() {
  Decoder& d = *decoder_;
  const std::size_t before = pending_.size();
  const auto where = [&] { return name_ + ": line " + std::to_string(1 + lines_seen_) + ": "; };
  const auto refill = [&] {
    if (d.in_pos < d.in_end || d.raw_ended) return;
    d.in_pos = 0;
    d.in_end = read_raw(d.in.data(), d.in.size());
    d.raw_total += d.in_end;
    if (d.in_end == 0) d.raw_ended = true;
  };
  bool more = true;
  if (d.packing == Packing::none) {
    pending_.resize(before + raw_chunk);
    const std::size_t got = read_raw(pending_.data() + before, raw_chunk);
    pending_.resize(before + got);
    more = got > 0;
  } else if (d.packing == Packing::gzip) {
#if LLMTRAIN_HAVE_ZLIB
    refill();
    d.z.next_in = reinterpret_cast<Bytef*>(d.in.data() + d.in_pos);
    d.z.avail_in = uInt(d.in_end - d.in_pos);
    d.z.next_out = reinterpret_cast<Bytef*>(d.out.data());
    d.z.avail_out = uInt(d.out.size());
    const int status = inflate(&d.z, Z_NO_FLUSH);
    pending_.append(d.out.data(), d.out.size() - d.z.avail_out);
    d.in_pos = d.in_end - d.z.avail_in;
    if (status == Z_STREAM_END) {
      refill();
      if (d.in_pos == d.in_end) {
        more = false;
      } else {
        inflateReset(&d.z);  // a further gzip member follows (concatenated .gz files)
      }
    } else if (status == Z_BUF_ERROR && d.in_pos == d.in_end && d.raw_ended) {  // input used up inside a member
      lines_seen_ += std::count(pending_.begin() + std::ptrdiff_t(before), pending_.end(), '\n');
      throw InputError(where() + "the gzip stream ends early (a truncated file?)");
    } else if (status != Z_OK && status != Z_BUF_ERROR) {
      lines_seen_ += std::count(pending_.begin() + std::ptrdiff_t(before), pending_.end(), '\n');
      throw InputError(where() + "corrupt gzip data (" + (d.z.msg ? d.z.msg : "error " + std::to_string(status)) + ")");
    }
#endif
  } else {
#if LLMTRAIN_HAVE_ZSTD
    refill();
    if (d.in_pos == d.in_end && !d.full) {  // every byte read and decoded
      if (d.left != 0 || d.raw_total == 0) throw InputError(where() + "the Zstandard stream ends early (a truncated file?)");
      more = false;
    } else {
      ZSTD_inBuffer in{d.in.data(), d.in_end, d.in_pos};
      ZSTD_outBuffer o{d.out.data(), d.out.size(), 0};
      const std::size_t status = ZSTD_decompressStream(d.zstd, &o, &in);
      if (ZSTD_isError(status)) {
        throw InputError(where() + "corrupt Zstandard data (" + ZSTD_getErrorName(status) + ")");
      }
      pending_.append(d.out.data(), o.pos);
      d.full = o.pos == o.size;
      if (o.pos > 0 || in.pos > d.in_pos) d.left = status;  // a call that did nothing says nothing
      d.in_pos = in.pos;
    }
#endif
  }
  lines_seen_ += std::count(pending_.begin() + std::ptrdiff_t(before), pending_.end(), '\n');
  return more;
}

bool TextReader::next(std::string& block, std::int64_t& first_line) {
  std::size_t searched = 0;  // the bytes after head_ already searched for a place to cut
  while (true) {
    const std::string_view text = std::string_view(pending_).substr(head_);
    if (ended_ || text.size() >= block_bytes_) {
      std::size_t cut = std::string::npos;
      if (ended_) {
        if (text.empty() && (gave_block_ || format_ == TextFormat::jsonl)) return false;
        cut = text.size();
      } else if (format_ == TextFormat::jsonl) {  // the first line end from block_bytes_ on
        const std::size_t newline = text.find('\n', std::max(searched, block_bytes_ - 1));
        if (newline != std::string_view::npos) cut = newline + 1;
      } else {  // the first safe place from block_bytes_ on
        for (std::size_t at = std::max(searched, block_bytes_); at < text.size(); ++at) {
          if (safe_cut(text, at)) {
            cut = at;
            break;
          }
        }
      }
      if (cut != std::string::npos) {
        block.assign(text.substr(0, cut));
        head_ += cut;
        first_line = next_line_;
        next_line_ += std::count(block.begin(), block.end(), '\n');
        gave_block_ = true;
        return true;
      }
      searched = text.size();
    }
    if (head_ > 0) {  // drop what was handed out before reading more
      pending_.erase(0, head_);
      head_ = 0;
    }
    if (!fill()) ended_ = true;
  }
}

void for_each_json_line(const std::string& path, std::string_view text,
                        const std::function<bool(const nlohmann::json& object, const std::string& where)>& each,
                        std::int64_t first_line) {
  std::size_t start = 0;
  for (std::int64_t line = first_line; start < text.size(); ++line) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view row = text.substr(start, end - start);
    start = end + 1;
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    if (row.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    if (std::size_t bad = 0; !is_valid_utf8(row, &bad)) {
      throw InputError(where + ": byte " + std::to_string(bad + 1) + " of the line is not valid UTF-8");
    }
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(row);
    } catch (const nlohmann::json::parse_error& e) {
      std::string reason = e.what();
      if (const auto colon = reason.find("]: "); colon != std::string::npos) reason = reason.substr(colon + 3);
      throw InputError(where + ": malformed JSON: " + reason);
    }
    if (!object.is_object()) throw InputError(where + ": expected a JSON object, got " + json_excerpt(object));
    if (!each(object, where)) return;
  }
}

void json_documents(const std::string& path, std::string_view text, std::int64_t first_line,
                    const std::string& jsonl_field, std::vector<std::string>& documents) {
  for_each_json_line(
      path, text,
      [&](const nlohmann::json& object, const std::string& where) {
        const auto it = object.find(jsonl_field);
        if (it == object.end()) throw InputError(where + ": no \"" + jsonl_field + "\" field (--jsonl-field)");
        if (!it->is_string()) {
          throw InputError(where + ": \"" + jsonl_field + "\" is not a string, got " + json_excerpt(*it));
        }
        documents.push_back(it->get<std::string>());
        return true;
      },
      first_line);
}

bool reads_gzip() {
#if LLMTRAIN_HAVE_ZLIB
  return true;
#else
  return false;
#endif
}

bool reads_zstd() {
#if LLMTRAIN_HAVE_ZSTD
  return true;
#else
  return false;
#endif
}

}  // namespace llmtrain::data
