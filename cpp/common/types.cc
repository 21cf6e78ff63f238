#include "common/types.h"

namespace kvroute {

Medium ParseMedium(std::string_view s, bool* known) {
  *known = true;
  if (s == "GPU" || s == "gpu" || s == "CUDA" || s == "cuda") return Medium::kGpu;
  if (s.find("CPU") != std::string_view::npos || s.find("cpu") != std::string_view::npos) {
    return Medium::kCpu;
  }
  if (s == "STORAGE" || s == "DISK" || s == "SSD" || s == "disk" || s == "storage" ||
      s == "EXTERNAL") {
    return Medium::kDisk;
  }
  // Deliberately fail towards the weakest tier: an unknown medium is credited like disk.
  *known = false;
  return Medium::kDisk;
}

const char* MediumName(Medium m) {
  switch (m) {
    case Medium::kGpu: return "GPU";
    case Medium::kCpu: return "CPU";
    case Medium::kDisk: return "DISK";
  }
  return "?";
}

}  // namespace kvroute
