// Byte-level BPE as GPT-2 defines it: files, encoding and training.
//
// Tokens are kept as raw bytes in memory. GPT-2's files spell each byte as a printable Unicode
// character (bytes_to_unicode below), so they are translated on read and write.
#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <limits>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "data/tokenizer.h"

namespace llmtrain::data {
namespace {

// GPT-2's byte <-> character table: printable Latin-1 bytes stand for themselves, the other 68
// bytes map to code points 256, 257, ... in byte order. byte_order lists bytes in the order of
// GPT-2's first 256 token ids (printable ones first).
struct ByteTable {
  std::array<std::uint32_t, 256> code_point{};
  std::array<std::uint8_t, 256> byte_order{};
  std::unordered_map<std::uint32_t, std::uint8_t> byte_of;

  ByteTable() {
    const auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
    int next = 0, extra = 0;
    for (int b = 0; b < 256; ++b) {
      if (printable(b)) byte_order[next++] = std::uint8_t(b);
    }
    for (int b = 0; b < 256; ++b) {
      if (!printable(b)) byte_order[next++] = std::uint8_t(b);
      code_point[b] = printable(b) ? std::uint32_t(b) : std::uint32_t(256 + extra++);
      byte_of[code_point[b]] = std::uint8_t(b);
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

std::string bytes_to_unicode(std::string_view bytes) {
  std::string out;
  for (const unsigned char b : bytes) {
    const std::uint32_t cp = byte_table().code_point[b];
    if (cp < 0x80) {
      out.push_back(char(cp));
    } else {  // all code points here are below 0x800: two UTF-8 bytes
      out.push_back(char(0xC0 | (cp >> 6)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

// Returns false when `text` has a character outside the byte table.
bool unicode_to_bytes(std::string_view text, std::string& out) {
  out.clear();
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::uint32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < text.size()) {
      cp = (std::uint32_t(c & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
      i += 2;
    } else {
      return false;
    }
    const auto it = byte_table().byte_of.find(cp);
    if (it == byte_table().byte_of.end()) return false;
    out.push_back(char(it->second));
  }
  return true;
}

constexpr std::string_view eot_text = "<|endoftext|>";

std::uint64_t pair_key(std::uint32_t a, std::uint32_t b) { return (std::uint64_t(a) << 32) | b; }

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeVocabulary vocab) : vocab_(std::move(vocab)) {
    std::unordered_map<std::string, std::uint32_t> id_of;
    for (std::uint32_t id = 0; id < vocab_.tokens.size(); ++id) id_of.emplace(vocab_.tokens[id], id);
    for (int b = 0; b < 256; ++b) {
      const auto it = id_of.find(std::string(1, char(b)));
      if (it == id_of.end()) throw InputError("BPE vocabulary has no token for byte " + std::to_string(b));
      byte_id_[b] = it->second;
    }
    for (std::uint32_t rank = 0; rank < vocab_.merges.size(); ++rank) {
      const auto [a, b] = vocab_.merges[rank];
      const auto merged = id_of.find(vocab_.tokens[a] + vocab_.tokens[b]);
      if (merged == id_of.end()) throw InputError("BPE merge " + std::to_string(rank) + " makes no known token");
      merges_.emplace(pair_key(a, b), Merge{rank, merged->second});
    }
  }

  std::string kind() const override { return "gpt2"; }
  std::uint32_t vocab_size() const override { return std::uint32_t(vocab_.tokens.size()); }
  std::optional<std::uint32_t> eot_token() const override { return vocab_.eot; }
  std::string_view token_bytes(std::uint32_t token) const override { return vocab_.tokens.at(token); }
  const BpeVocabulary* bpe_vocabulary() const override { return &vocab_; }

  void encode(std::string_view text, std::vector<std::uint32_t>& out) const override {
    // Pieces repeat a lot in text ("the", " and"): a per-thread cache skips their merges. Long
    // pieces (a run of letters without spaces) are rare and would only fill the cache.
    constexpr std::size_t cached_piece_bytes = 256;
    constexpr std::size_t cached_pieces = 1u << 16;  // then cleared: a few MB a thread, whatever the corpus
    thread_local struct {
      std::uint64_t owner = 0;  // serial_ of the tokenizer: an address can be reused by the next one
      std::unordered_map<std::string, std::vector<std::uint32_t>> tokens;
    } cache;
    if (cache.owner != serial_ || cache.tokens.size() > cached_pieces) {
      cache.tokens.clear();
      cache.owner = serial_;
    }
    thread_local std::vector<std::string_view> pieces;
    thread_local std::vector<std::uint32_t> merged;
    pieces.clear();
    pretokenize(text, pieces);
    for (const auto piece : pieces) {
      if (piece.size() > cached_piece_bytes) {
        merge_piece(piece, merged);
        out.insert(out.end(), merged.begin(), merged.end());
        continue;
      }
      const std::string key(piece);
      auto it = cache.tokens.find(key);
      if (it == cache.tokens.end()) {
        merge_piece(piece, merged);
        it = cache.tokens.emplace(key, merged).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
  }

 private:
  struct Merge {
    std::uint32_t rank;
    std::uint32_t result;
  };

  const Merge* find_merge(std::uint32_t a, std::uint32_t b) const {
    const auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  // Applies merges to the bytes of one piece with GPT-2's rule: the lowest-rank pair present is
  // merged at every (non-overlapping) place, left to right, then the next lowest, and so on.
  //
  // Rescanning all pairs after each merge is quadratic: a 100 KB run of letters took 7.7 s. Here
  // the parts are a linked list over the byte positions (a part keeps the position of its first
  // byte), and the places where a pair may merge wait in one list per rank; a small min-heap
  // holds the ranks whose lists are not empty. One rank is taken at a time, its places sorted
  // and merged left to right, so a merge costs O(1) plus its share of a sort. (A heap of all
  // (rank, place) entries costs as much in theory, but on a 10 MB run its cache misses made it
  // 5x slower.) Entries are not removed when a neighbour merge changes their pair: an entry is
  // checked against the pair now at its place and dropped when that pair's rank differs (a
  // rank names one pair, and parts only grow, so a stale entry never matches again). A new pair
  // of lower rank than the one being merged waits for the next round, as GPT-2's rule finishes
  // one rank everywhere first (only merge lists out of training order make such pairs).
  void merge_piece(std::string_view piece, std::vector<std::uint32_t>& result) const {
    const std::size_t n = piece.size();
    result.clear();
    if (n <= short_piece_bytes) {
      merge_short_piece(piece, result);
      return;
    }
    if (n >= std::numeric_limits<std::uint32_t>::max()) {
      throw InputError("BPE: a run of " + std::to_string(n) + " bytes without a break is over the 4 GiB limit");
    }
    constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();
    struct Scratch {
      std::vector<std::uint32_t> token, next, prev;  // per position; token `none` = merged away
      std::vector<std::vector<std::uint32_t>> places;  // per rank: positions where its pair may be
      std::vector<std::uint32_t> ranks;                // min-heap of the ranks with places
      std::vector<std::uint32_t> round;                // the places of the rank being merged
      std::uint64_t owner = 0;  // serial_ of the tokenizer the lists are sized for
    };
    thread_local Scratch s;
    if (s.owner != serial_) {  // the lists are empty between calls: only their count can be stale
      s.places.assign(vocab_.merges.size(), {});
      s.owner = serial_;
    }
    s.token.resize(n);
    s.next.resize(n);
    s.prev.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      s.token[i] = byte_id_[static_cast<unsigned char>(piece[i])];
      s.next[i] = std::uint32_t(i + 1);
      s.prev[i] = i == 0 ? none : std::uint32_t(i - 1);
    }
    const auto later = std::greater<std::uint32_t>();  // min-heap
    const auto add = [&](std::uint32_t position) {
      const Merge* m = find_merge(s.token[position], s.token[s.next[position]]);
      if (!m) return;
      auto& list = s.places[m->rank];
      if (list.empty()) {
        s.ranks.push_back(m->rank);
        std::push_heap(s.ranks.begin(), s.ranks.end(), later);
      }
      list.push_back(position);
    };
    for (std::uint32_t i = 0; i + 1 < n; ++i) add(i);

    while (!s.ranks.empty()) {
      std::pop_heap(s.ranks.begin(), s.ranks.end(), later);
      const std::uint32_t rank = s.ranks.back();
      s.ranks.pop_back();
      s.round.swap(s.places[rank]);  // the list is left empty (and keeps round's old capacity)
      if (!std::is_sorted(s.round.begin(), s.round.end())) std::sort(s.round.begin(), s.round.end());
      for (const std::uint32_t left : s.round) {
        if (s.token[left] == none || s.next[left] == n) continue;
        const std::uint32_t right = s.next[left];
        const Merge* m = find_merge(s.token[left], s.token[right]);
        if (!m || m->rank != rank) continue;  // stale: a neighbour merged since this entry was made
        s.token[left] = m->result;
        s.token[right] = none;
        s.next[left] = s.next[right];
        if (s.next[left] != n) {
          s.prev[s.next[left]] = left;
          add(left);
        }
        if (s.prev[left] != none) add(s.prev[left]);
      }
      s.round.clear();
    }
    for (std::uint32_t i = 0; i != n; i = s.next[i]) result.push_back(s.token[i]);
    if (n > (1u << 20)) s = Scratch{};  // a long run's memory is not kept for the next piece
  }

  // The plain rule for the short pieces of ordinary text (a word: a few bytes): rescan the pairs
  // after each merge. Quadratic, but with no set-up it is 2x faster there than the lists above.
  static constexpr std::size_t short_piece_bytes = 32;
  void merge_short_piece(std::string_view piece, std::vector<std::uint32_t>& symbols) const {
    for (const unsigned char c : piece) symbols.push_back(byte_id_[c]);
    while (symbols.size() > 1) {
      const Merge* best = nullptr;
      std::uint64_t best_pair = 0;
      for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
        const Merge* m = find_merge(symbols[i], symbols[i + 1]);
        if (m && (!best || m->rank < best->rank)) {
          best = m;
          best_pair = pair_key(symbols[i], symbols[i + 1]);
        }
      }
      if (!best) break;
      std::size_t write = 0;
      for (std::size_t i = 0; i < symbols.size(); ++write) {
        if (i + 1 < symbols.size() && pair_key(symbols[i], symbols[i + 1]) == best_pair) {
          symbols[write] = best->result;
          i += 2;
        } else {
          symbols[write] = symbols[i];
          i += 1;
        }
      }
      symbols.resize(write);
    }
  }

  static std::uint64_t next_serial() {
    static std::atomic<std::uint64_t> count{0};
    return ++count;
  }

  const std::uint64_t serial_ = next_serial();
  BpeVocabulary vocab_;
  std::array<std::uint32_t, 256> byte_id_{};
  std::unordered_map<std::uint64_t, Merge> merges_;
};

}  // namespace

BpeVocabulary read_bpe_files(const std::string& dir) {
  const std::string encoder_path = dir + "/encoder.json";
  const std::string merges_path = dir + "/vocab.bpe";
  const nlohmann::json encoder = read_json_file(encoder_path, "GPT-2's encoder.json");
  if (!encoder.is_object() || encoder.empty()) throw InputError(encoder_path + ": expected an object of token -> id");

  BpeVocabulary vocab;
  vocab.tokens.resize(encoder.size());
  std::vector<bool> seen(encoder.size(), false);
  std::string bytes;
  for (const auto& [text, id_json] : encoder.items()) {
    if (!id_json.is_number_unsigned() || id_json.get<std::uint64_t>() >= encoder.size()) {
      throw InputError(encoder_path + ": token " + json_excerpt(text) + ": id must be an integer below " +
                       std::to_string(encoder.size()));
    }
    const auto id = id_json.get<std::uint32_t>();
    if (seen[id]) throw InputError(encoder_path + ": id " + std::to_string(id) + " is used twice");
    seen[id] = true;
    if (text == eot_text) {
      vocab.eot = id;
      bytes = text;
    } else if (!unicode_to_bytes(text, bytes)) {
      throw InputError(encoder_path + ": token " + json_excerpt(text) + " is not in GPT-2's byte-to-character form");
    }
    vocab.tokens[id] = bytes;
  }

  std::istringstream merges_file(read_regular_file(merges_path, "GPT-2's vocab.bpe", std::uint64_t(1) << 30));
  std::unordered_map<std::string, std::uint32_t> id_of;
  for (std::uint32_t id = 0; id < vocab.tokens.size(); ++id) {
    if (!(vocab.eot && *vocab.eot == id)) id_of.emplace(vocab.tokens[id], id);
  }
  std::string line, left, right;
  for (std::size_t number = 1; std::getline(merges_file, line); ++number) {
    if (line.starts_with("#version") || line.empty()) continue;
    const auto space = line.find(' ');
    const auto merge_at = merges_path + ":" + std::to_string(number);
    if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
      throw InputError(merge_at + ": expected two tokens separated by one space");
    }
    if (!unicode_to_bytes(std::string_view(line).substr(0, space), left) ||
        !unicode_to_bytes(std::string_view(line).substr(space + 1), right)) {
      throw InputError(merge_at + ": not in GPT-2's byte-to-character form");
    }
    const auto a = id_of.find(left), b = id_of.find(right), ab = id_of.find(left + right);
    if (a == id_of.end() || b == id_of.end() || ab == id_of.end()) {
      throw InputError(merge_at + ": merge of tokens that encoder.json does not have");
    }
    vocab.merges.emplace_back(a->second, b->second);
  }
  return vocab;
}

void save_bpe_files(const BpeVocabulary& vocab, const std::string& dir) {
  // encoder.json is written by hand, in id order: an ordered_json object looks keys up by a linear
  // scan, which made 50k tokens cost about 4 s. A repeated token (possible in a merge list that
  // builds one string twice) keeps its first place with its last id, as that object did.
  std::vector<std::string> keys(vocab.tokens.size());
  std::vector<std::uint32_t> id_of_key(vocab.tokens.size());
  std::unordered_map<std::string_view, std::size_t> place;
  place.reserve(vocab.tokens.size());
  std::size_t places = 0;
  for (std::uint32_t id = 0; id < vocab.tokens.size(); ++id) {
    std::string key = vocab.eot && *vocab.eot == id ? std::string(eot_text) : bytes_to_unicode(vocab.tokens[id]);
    if (const auto it = place.find(key); it != place.end()) {
      id_of_key[it->second] = id;
      continue;
    }
    keys[places] = std::move(key);  // `keys` never reallocates: the views into it stay valid
    place.emplace(keys[places], places);
    id_of_key[places++] = id;
  }
  std::string encoder = "{";
  for (std::size_t i = 0; i < places; ++i) {
    if (i) encoder += ',';
    encoder += nlohmann::json(keys[i]).dump();
    encoder += ':';
    encoder += std::to_string(id_of_key[i]);
  }
  encoder += '}';
  std::string merges = "#version: 0.2\n";
  for (const auto& [a, b] : vocab.merges) {
    merges += bytes_to_unicode(vocab.tokens[a]);
    merges += ' ';
    merges += bytes_to_unicode(vocab.tokens[b]);
    merges += '\n';
  }
  // Exclusive temporaries renamed into place: a planted link is never followed, and a crash
  // leaves the old files or the new ones.
  write_file_atomic(dir + "/encoder.json", encoder);
  write_file_atomic(dir + "/vocab.bpe", merges);
}

std::unique_ptr<Tokenizer> make_bpe_tokenizer(BpeVocabulary vocab) {
  return std::make_unique<BpeTokenizer>(std::move(vocab));
}

void count_pieces(std::string_view text, std::unordered_map<std::string, std::int64_t>& counts) {
  std::vector<std::string_view> pieces;
  pretokenize(text, pieces);
  for (const auto p : pieces) ++counts[std::string(p)];
}

BpeVocabulary train_bpe(const std::vector<std::string_view>& documents, std::uint32_t vocab_size) {
  // Distinct pieces with their counts: merges never cross a piece boundary.
  std::unordered_map<std::string, std::int64_t> piece_count;
  for (const auto document : documents) count_pieces(document, piece_count);
  return train_bpe_counts(piece_count, vocab_size);
}

BpeVocabulary train_bpe_counts(const std::unordered_map<std::string, std::int64_t>& piece_count, std::uint32_t vocab_size) {
  if (vocab_size < 257) throw InputError("bpe:" + std::to_string(vocab_size) + ": needs at least 257 tokens (256 bytes + end of text)");
  BpeVocabulary vocab;
  std::array<std::uint32_t, 256> byte_id{};
  for (int i = 0; i < 256; ++i) {
    byte_id[byte_table().byte_order[i]] = std::uint32_t(i);
    vocab.tokens.emplace_back(1, char(byte_table().byte_order[i]));
  }

  struct Word {
    std::vector<std::uint32_t> symbols;
    std::int64_t count;
  };
  std::vector<Word> words;
  words.reserve(piece_count.size());
  for (const auto& [piece, count] : piece_count) {
    Word w{{}, count};
    for (const unsigned char c : piece) w.symbols.push_back(byte_id[c]);
    words.push_back(std::move(w));
  }

  // Pair counts over all words, and which words may hold each pair (may be stale: rechecked).
  std::unordered_map<std::uint64_t, std::int64_t> pair_count;
  std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> pair_words;
  const auto add_pairs = [&](std::uint32_t w, std::int64_t sign) {
    const auto& s = words[w].symbols;
    for (std::size_t i = 0; i + 1 < s.size(); ++i) {
      const auto key = pair_key(s[i], s[i + 1]);
      pair_count[key] += sign * words[w].count;
      if (sign > 0) pair_words[key].push_back(w);
    }
  };
  for (std::uint32_t w = 0; w < words.size(); ++w) add_pairs(w, +1);

  std::vector<std::uint32_t> visited(words.size(), 0);
  const std::uint32_t merges_wanted = vocab_size - 257;
  for (std::uint32_t merge = 1; merge <= merges_wanted; ++merge) {
    std::uint64_t best = 0;
    std::int64_t best_count = 0;
    for (const auto& [key, count] : pair_count) {
      if (count <= 0) continue;
      if (count > best_count) {
        best = key;
        best_count = count;
      } else if (count == best_count) {  // tie: the smaller (left bytes, right bytes)
        const auto& t = vocab.tokens;
        const auto candidate = std::tie(t[key >> 32], t[key & 0xFFFFFFFF]);
        if (candidate < std::tie(t[best >> 32], t[best & 0xFFFFFFFF])) best = key;
      }
    }
    if (best_count == 0) break;
    const auto a = std::uint32_t(best >> 32), b = std::uint32_t(best & 0xFFFFFFFF);
    const auto merged = std::uint32_t(vocab.tokens.size());
    vocab.tokens.push_back(vocab.tokens[a] + vocab.tokens[b]);
    vocab.merges.emplace_back(a, b);

    const std::vector<std::uint32_t> candidates = std::move(pair_words[best]);
    pair_words.erase(best);
    for (const auto w : candidates) {
      if (visited[w] == merge) continue;
      visited[w] = merge;
      auto& s = words[w].symbols;
      bool has_pair = false;
      for (std::size_t i = 0; i + 1 < s.size() && !has_pair; ++i) has_pair = s[i] == a && s[i + 1] == b;
      if (!has_pair) continue;
      add_pairs(w, -1);
      std::size_t write = 0;
      for (std::size_t i = 0; i < s.size(); ++write) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          s[write] = merged;
          i += 2;
        } else {
          s[write] = s[i];
          i += 1;
        }
      }
      s.resize(write);
      add_pairs(w, +1);
    }
    pair_count.erase(best);
  }
  vocab.eot = std::uint32_t(vocab.tokens.size());
  vocab.tokens.emplace_back(eot_text);
  return vocab;
}

}  // namespace llmtrain::data
