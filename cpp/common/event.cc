#include "common/event.h"

namespace kvroute {

const char* DropReasonName(DropReason r) {
  switch (r) {
    case DropReason::kTruncated: return "truncated";
    case DropReason::kParseError: return "parse_error";
    case DropReason::kOversized: return "oversized";
    case DropReason::kWrongType: return "wrong_type";
    case DropReason::kUnknownTag: return "unknown_tag";
    case DropReason::kBadTokenCount: return "bad_token_count";
    case DropReason::kTokenOutOfRange: return "token_out_of_range";
    case DropReason::kTrailingBytes: return "trailing_bytes";
    case DropReason::kBlockSizeMismatch: return "block_size_mismatch";
    case DropReason::kBadFrames: return "bad_frames";
    case DropReason::kRankMismatch: return "rank_mismatch";
    case DropReason::kUnsupportedSpec: return "unsupported_spec";
    case DropReason::kCount: break;
  }
  return "?";
}

}  // namespace kvroute
