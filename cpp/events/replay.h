// The engines' replay protocol, client side (docs/kv-events.md §2.2): what a DEALER sends
// to an engine's replay ROUTER socket and how its replies read. Framing only: the caller
// owns the socket, the timeout and what to do with the batches.
//
// Thread safety: pure functions; the socket passed in must be used by one thread.
#pragma once

#include <cstdint>
#include <vector>
#include <zmq.hpp>

namespace kvroute {

// seq of the end-of-replay marker (sent with an empty payload).
constexpr uint64_t kReplayEnd = 0xFFFFFFFFFFFFFFFFull;

// An 8-byte big-endian sequence number (frame 1 of a live message, or of a reply).
uint64_t ReadSeq(const void* p);

// Sends ["", start (8 bytes big-endian)]: every buffered batch with seq >= start is replayed.
void SendReplayRequest(zmq::socket_t& dealer, uint64_t start);

struct ReplayReply {
  uint64_t seq = 0;  // kReplayEnd marks the end
  const char* payload = nullptr;
  size_t payload_len = 0;
};

// One reply as a DEALER receives it: ["", seq, payload] (older vLLM, SGLang) or
// ["", topic, seq, payload] (vLLM after PR #45177). False for any other shape.
bool ParseReplayReply(const std::vector<zmq::message_t>& frames, ReplayReply* out);

}  // namespace kvroute
