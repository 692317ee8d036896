#pragma once

// The part of ATen the ops use: tensors with their methods and operators, parallel_for, and the few functions
// called by name. <ATen/ATen.h> declares every operator of torch and doubles each file's compile time.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isin.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
