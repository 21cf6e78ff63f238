#include "events/replay.h"

namespace kvroute {

uint64_t ReadSeq(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
  return v;
}

void SendReplayRequest(zmq::socket_t& dealer, uint64_t start) {
  unsigned char req[8];
  for (int i = 0; i < 8; ++i) req[i] = static_cast<unsigned char>(start >> (56 - 8 * i));
  dealer.send(zmq::message_t(), zmq::send_flags::sndmore);  // empty delimiter
  dealer.send(zmq::message_t(req, 8), zmq::send_flags::none);
}

bool ParseReplayReply(const std::vector<zmq::message_t>& frames, ReplayReply* out) {
  if (frames.size() < 3 || frames[0].size() != 0) return false;
  const size_t n = frames.size() - 1;
  if (n != 2 && n != 3) return false;
  const zmq::message_t& seq = frames[n == 2 ? 1 : 2];
  const zmq::message_t& payload = frames[n == 2 ? 2 : 3];
  if (seq.size() != 8) return false;
  out->seq = ReadSeq(seq.data());
  out->payload = static_cast<const char*>(payload.data());
  out->payload_len = payload.size();
  return true;
}

}  // namespace kvroute
