// CUB for the CPU emulation: only the radix sort.
#pragma once

#include "cub/device/device_radix_sort.cuh"
