// cuda_runtime.h — emulator stand-in for the CUDA header of the same name: everything lives in emulator.h.
#pragma once
#include "../emulator.h"
