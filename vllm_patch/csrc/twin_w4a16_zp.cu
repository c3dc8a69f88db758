// Instances of the W4A16 decode kernel with HAS_Z = true (zero points), DEEP = false (one file per flavour and
// scale ring: the build compiles them in parallel).
#include "twin_w4a16.cuh"

namespace twin_w4 {
TWIN_W4_FOR_EACH_GS_D(TWIN_W4_INSTANTIATE, true, false)
}  // namespace twin_w4
