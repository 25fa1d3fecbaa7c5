// What a training run is asked to do: the config, the run folder, the device and the resume
// point, as the `train` command reads them.
#pragma once

#include <string>

#include "config/config.h"
#include "core/tensor.h"

namespace llmtrain::train {

struct TrainOptions {
  config::Config config;
  std::string run_dir;
  Device device = Device::cpu;
  bool device_auto = false;    // --device auto: run_training picks CUDA or the CPU (resolve_device)
  std::string device_note;     // why that device was picked, for the log
  bool progress = true;        // progress lines on stderr
  bool profile_ops = false;    // print the time spent in each op at the end
  std::string resume = "auto";  // auto | never | a checkpoint path
};

}  // namespace llmtrain::train
