// The torch-free C++ tests' one assertion: print the failed condition with its line and exit 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)
