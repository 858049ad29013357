// main() of the GPU tests: exits 77 (ctest: skipped) with the reason when there is no GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "kiln/runtime.h"

int main(int argc, char** argv) {
  kiln_runtime* rt = nullptr;
  kiln_status* st = kiln_runtime_create(nullptr, &rt);
  if (kiln_status_get_code(st) == KILN_STATUS_NO_DEVICE) {
    std::printf("SKIP: runtime GPU tests need a GPU: %s\n", kiln_status_get_message(st));
    kiln_status_release(st);
    return 77;
  }
  kiln_status_release(st);
  kiln_runtime_release(rt);
  doctest::Context context(argc, argv);
  return context.run();
}
