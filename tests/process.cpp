#include "process.h"

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

namespace llmtrain::test {
namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q.append("'\\''");
    } else {
      q.push_back(c);
    }
  }
  q.push_back('\'');
  return q;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TempDir::TempDir() {
  std::random_device seed;
  const auto base = std::filesystem::temp_directory_path();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto candidate = base / ("llmtrain-test-" + std::to_string(seed()));
    if (std::filesystem::create_directory(candidate)) {
      path_ = candidate.string();
      return;
    }
  }
  throw std::runtime_error("TempDir: cannot create a directory under " + base.string());
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string TempDir::write(const std::string& name, const std::string& text) const {
  const std::string full = path_ + "/" + name;
  std::ofstream(full, std::ios::binary) << text;
  return full;
}

ProcessResult run_llmtrain(const std::vector<std::string>& args) {
  TempDir dir;
  std::string command = shell_quote(LLMTRAIN_BINARY);
  // Appended piece by piece: GCC 12 gives a false -Wrestrict on `"literal" + std::string`.
  for (const auto& a : args) command.append(" ").append(shell_quote(a));
  const std::string out_path = dir.path() + "/out", err_path = dir.path() + "/err";
  command.append(" </dev/null >").append(out_path).append(" 2>").append(err_path);
  const int status = std::system(command.c_str());
  ProcessResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = read_file(out_path);
  result.err = read_file(err_path);
  return result;
}

}  // namespace llmtrain::test
