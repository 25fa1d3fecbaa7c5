// The points of a forward or backward pass that whoever owns a model's weights or reduces its
// gradients may need to act at: ZeRO 3 gathers a layer's or an end's weights before it runs and
// reduces its gradients after; ZeRO 0-2 start reducing the gradients as each layer completes them.
// The model only reports them: what they mean for storage or communication is the observer's.
#pragma once

namespace llmtrain::model {

enum class PassEvent {
  forward_begins,             // before anything of a forward pass
  before_embedding,           // the embedding's forward is about to read its weights (ModelEnd::embedding)
  after_embedding,            // the embedding's forward is done
  before_forward,             // layer `layer`'s forward is about to read its weights
  after_forward,              // layer `layer`'s forward is done
  before_head,                // the final norm's and the head's forward are about to read their weights (ModelEnd::head)
  before_head_backward,       // the head's and final norm's backward are about to read their weights and add gradients
  after_head_backward,        // their gradients of this micro-batch are complete
  before_backward,            // layer `layer`'s backward is about to read its weights and add its gradients
  after_backward,             // layer `layer`'s gradients of this micro-batch are complete
  before_embedding_backward,  // the embedding's backward is about to add its gradients (it reads no weights)
  backward_ends,              // the gradients of the parameters outside the layers are complete
};

/// The two ends of the model outside the layers, and the parameters each reads
/// (Model::end_runs): the embedding (token and learned position tables), and the final norm with
/// the output head (the token table itself when the head is tied to it).
enum class ModelEnd { embedding, head };

/// Told of each PassEvent as forward and backward reach it (Model::set_observer).
class PassObserver {
 public:
  virtual ~PassObserver() = default;
  /// `layer`: the layer the event is about, -1 for the events outside the layers.
  virtual void on(PassEvent event, int layer) = 0;
};

}  // namespace llmtrain::model
