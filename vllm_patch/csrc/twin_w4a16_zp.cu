// Instances of the W4A16 decode kernel with HAS_Z = true (one file per flavour: the build compiles them in parallel).
#include "twin_w4a16.cuh"

namespace twin_w4 {
TWIN_W4_FOR_EACH_GS(TWIN_W4_INSTANTIATE, true)
}  // namespace twin_w4
