// Instances of the staged W4A16 decode kernel (twin_w4a16_pipe.cuh), both flavours.
#include "twin_w4a16_pipe.cuh"

namespace twin_w4 {
TWIN_W4_PIPE_FOR_EACH(TWIN_W4_INSTANTIATE_PIPE)
}  // namespace twin_w4
