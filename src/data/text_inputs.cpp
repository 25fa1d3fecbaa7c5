#include "data/text_inputs.h"

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <exception>
#include <string_view>
#include <thread>
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

// The line a decompressed stream had reached: 1 + its newlines.
std::int64_t line_reached(const std::string& text) { return 1 + std::count(text.begin(), text.end(), '\n'); }

std::string gunzip(const std::string& path, const std::string& packed) {
#if LLMTRAIN_HAVE_ZLIB
  std::string out;
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) throw RuntimeError("zlib: inflateInit2 failed");
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(packed.data()));
  std::size_t fed = std::min<std::size_t>(UINT32_MAX, packed.size());  // over 4 GiB: in parts
  z.avail_in = uInt(fed);
  char buffer[1 << 16];
  while (true) {
    z.next_out = reinterpret_cast<Bytef*>(buffer);
    z.avail_out = sizeof buffer;
    const int status = inflate(&z, Z_NO_FLUSH);
    out.append(buffer, sizeof buffer - z.avail_out);
    if (z.avail_in == 0 && fed < packed.size()) {  // the next part of a large input
      const std::size_t more = std::min<std::size_t>(UINT32_MAX, packed.size() - fed);
      z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(packed.data() + fed));
      z.avail_in = uInt(more);
      fed += more;
    }
    if (status == Z_STREAM_END) {
      if (z.avail_in == 0 && fed == packed.size()) break;
      inflateReset(&z);  // a further gzip member follows (concatenated .gz files)
      continue;
    }
    if (status == Z_BUF_ERROR && z.avail_in == 0) {  // input used up inside a member
      inflateEnd(&z);
      throw InputError(path + ": line " + std::to_string(line_reached(out)) +
                       ": the gzip stream ends early (a truncated file?)");
    }
    if (status != Z_OK && status != Z_BUF_ERROR) {
      const std::string why = z.msg ? z.msg : "error " + std::to_string(status);
      inflateEnd(&z);
      throw InputError(path + ": line " + std::to_string(line_reached(out)) + ": corrupt gzip data (" + why + ")");
    }
  }
  inflateEnd(&z);
  return out;
#else
  (void)packed;
  throw InputError(path + ": this build reads no gzip input (build it with zlib: zlib1g-dev)");
#endif
}

std::string unzstd(const std::string& path, const std::string& packed) {
#if LLMTRAIN_HAVE_ZSTD
  std::string out;
  ZSTD_DStream* stream = ZSTD_createDStream();
  if (!stream) throw RuntimeError("libzstd: ZSTD_createDStream failed");
  ZSTD_inBuffer in{packed.data(), packed.size(), 0};
  std::vector<char> buffer(ZSTD_DStreamOutSize());
  std::size_t left = 1;  // 0 once a frame is whole and flushed
  bool full = false;     // the last call filled the buffer: the decoder may hold more
  while (in.pos < in.size || full) {
    ZSTD_outBuffer o{buffer.data(), buffer.size(), 0};
    const std::size_t read_before = in.pos;
    const std::size_t status = ZSTD_decompressStream(stream, &o, &in);
    if (ZSTD_isError(status)) {
      const std::string why = ZSTD_getErrorName(status);
      ZSTD_freeDStream(stream);
      throw InputError(path + ": line " + std::to_string(line_reached(out)) + ": corrupt Zstandard data (" + why + ")");
    }
    out.append(buffer.data(), o.pos);
    full = o.pos == o.size;
    if (o.pos > 0 || in.pos > read_before) left = status;  // a call that did nothing says nothing
  }
  ZSTD_freeDStream(stream);
  if (left != 0 || packed.empty()) {
    throw InputError(path + ": line " + std::to_string(line_reached(out)) +
                     ": the Zstandard stream ends early (a truncated file?)");
  }
  return out;
#else
  (void)packed;
  throw InputError(path + ": this build reads no Zstandard input (build it with libzstd: libzstd-dev)");
#endif
}

// One document per non-blank line: the string field `field` of the line's JSON object.
std::vector<std::string> json_lines(const std::string& path, const std::string& text, const std::string& field) {
  std::vector<std::string> documents;
  for_each_json_line(path, text, [&](const nlohmann::json& object, const std::string& where) {
    const auto it = object.find(field);
    if (it == object.end()) throw InputError(where + ": no \"" + field + "\" field (--jsonl-field)");
    if (!it->is_string()) {
      throw InputError(where + ": \"" + field + "\" is not a string, got " + json_excerpt(*it));
    }
    documents.push_back(it->get<std::string>());
    return true;
  });
  return documents;
}

}  // namespace

void for_each_json_line(const std::string& path, std::string_view text,
                        const std::function<bool(const nlohmann::json& object, const std::string& where)>& each) {
  std::size_t start = 0;
  for (std::int64_t line = 1; start < text.size(); ++line) {
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

std::vector<std::string> read_documents(const std::string& path, const std::string& jsonl_field) {
  std::string text = read_regular_file(path, "a text input file");
  std::string name = path;
  if (name.ends_with(".gz")) {
    text = gunzip(path, text);
    name.resize(name.size() - 3);
  } else if (name.ends_with(".zst")) {
    text = unzstd(path, text);
    name.resize(name.size() - 4);
  }
  if (name.ends_with(".jsonl")) return json_lines(path, text, jsonl_field);
  std::vector<std::string> one;
  one.push_back(std::move(text));
  return one;
}

std::vector<std::string> read_all_documents(const std::vector<std::string>& paths, const std::string& jsonl_field,
                                            int threads) {
  std::vector<std::vector<std::string>> per_file(paths.size());
  std::vector<std::exception_ptr> errors(paths.size());
  std::atomic<std::size_t> next{0};
  const auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < paths.size();) {
      try {
        per_file[i] = read_documents(paths[i], jsonl_field);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  const int n = std::clamp<int>(threads, 1, int(std::max<std::size_t>(1, paths.size())));
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  std::vector<std::string> documents;
  for (auto& file : per_file) {
    for (auto& d : file) documents.push_back(std::move(d));
  }
  return documents;
}

}  // namespace llmtrain::data
