// The ranks that hold one micro-batch's tokens between them: under context parallelism each holds
// a part of every sequence. Whatever is a statistic of the whole micro-batch (a MoE router's loads
// and losses) is summed over them.
#pragma once

#include <vector>

namespace llmtrain::model {

class TokenGroup {
 public:
  virtual ~TokenGroup() = default;
  virtual int size() const = 0;
  /// values = their sum over the group's ranks (host memory); every rank calls it together.
  virtual void sum(std::vector<double>& values) = 0;
};

}  // namespace llmtrain::model
