// Instances of the W4A16 decode kernel with HAS_Z = false (uint4b8), DEEP = true (one file per flavour and
// scale ring: the build compiles them in parallel).
#include "twin_w4a16.cuh"

namespace twin_w4 {
TWIN_W4_FOR_EACH_GS_D(TWIN_W4_INSTANTIATE, false, true)
}  // namespace twin_w4
