// A stored workload: u32 workers, u32 payloads, then per payload u32 worker, u32 length and
// the vLLM msgpack batch (compare_dynamo.py --dump-store writes it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

struct Payload {
  uint32_t worker;
  std::string bytes;
};
