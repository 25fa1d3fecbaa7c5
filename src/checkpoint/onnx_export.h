// ONNX export (export --format onnx): the model as one ONNX graph for ONNX Runtime, with the input
// and output names Hugging Face Optimum uses, so that existing generation loops run it unchanged.
//
//   inputs   input_ids (B,S) int64, attention_mask (B,P+S) int64 (1: token, 0: padding),
//            with the cache also position_ids (B,S) int64 and past_key_values.{i}.key|value (B,NKV,P,HS) f32
//   outputs  logits (B,S,V) f32, with the cache also present.{i}.key|value (B,NKV,P+S,HS) f32
//
// Built with the ONNX library's protobuf classes (libonnx-dev) and checked by its checker before
// it is written; optional at build time (LLMTRAIN_HAVE_ONNX).
#pragma once

#include <cstdint>
#include <string>

#include "model/model.h"

namespace llmtrain::checkpoint {

struct OnnxOptions {
  bool fp16 = false;          // weights stored as float16 (cast to float in the graph; computation stays f32)
  bool kv_cache = true;       // position_ids, past_key_values.* inputs and present.* outputs
  bool external_data = false; // weights in model.onnx.data even below protobuf's 2 GB limit
  /// Hand each weight's memory back to the OS once it is copied into the graph, so that the export
  /// holds the weights about once (the model's values read as zero afterwards): for a model
  /// loaded only to be exported.
  bool release_weights = false;
};

struct OnnxExportResult {
  std::int64_t weight_bytes = 0;  // bytes of all initializers
  bool external_data = false;     // whether they went to model.onnx.data
  int nodes = 0;
};

/// Whether this build can write ONNX (libonnx-dev and libprotobuf-dev found at configure time).
bool onnx_available();

/// Writes DIR/model.onnx (and DIR/model.onnx.data when the weights pass 2 GB or options ask for it),
/// after onnx::checker has passed the model. InputError naming the missing packages in builds
/// without ONNX.
OnnxExportResult export_onnx(const model::Model& model, const std::string& dir, const OnnxOptions& options);

}  // namespace llmtrain::checkpoint
