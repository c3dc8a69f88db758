// Instances of the TMA-fed W4A16 decode kernel (twin_w4a16_bulk.cuh), both flavours.
#include "twin_w4a16_bulk.cuh"

namespace twin_w4 {
TWIN_W4_BULK_FOR_EACH(TWIN_W4_INSTANTIATE_BULK)
}  // namespace twin_w4
