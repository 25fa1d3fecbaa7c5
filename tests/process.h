// Runs the llmtrain binary as a child process, as a user would, and captures what it printed.
#pragma once

#include <string>
#include <vector>

namespace llmtrain::test {

struct ProcessResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

/// Runs `llmtrain ARGS...` (each argument shell-quoted) and waits for it.
ProcessResult run_llmtrain(const std::vector<std::string>& args);

/// A fresh empty directory under the system temp dir, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  /// Writes `text` to path()/name and returns the full path.
  std::string write(const std::string& name, const std::string& text) const;

 private:
  std::string path_;
};

}  // namespace llmtrain::test
