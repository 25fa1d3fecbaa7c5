// The points of a forward or backward pass that whoever owns a model's weights may need to act at
// (parallel/zero3.h gathers a layer's weights before it runs and reduces its gradients after).
// The model only reports them: what they mean for storage or communication is the observer's.
#pragma once

namespace llmtrain::model {

enum class PassEvent {
  forward_begins,   // before anything of a forward pass (the parameters outside the layers are read)
  before_forward,   // layer `layer`'s forward is about to read its weights
  after_forward,    // layer `layer`'s forward is done
  before_backward,  // layer `layer`'s backward is about to read its weights and add its gradients
  after_backward,   // layer `layer`'s gradients of this micro-batch are complete
  backward_ends,    // the gradients of the parameters outside the layers are complete
};

/// Told of each PassEvent as forward and backward reach it (Model::set_observer).
class PassObserver {
 public:
  virtual ~PassObserver() = default;
  /// `layer`: the layer the event is about, -1 for forward_begins and backward_ends.
  virtual void on(PassEvent event, int layer) = 0;
};

}  // namespace llmtrain::model
