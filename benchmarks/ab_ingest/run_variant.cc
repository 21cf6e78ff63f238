// One variant's run, compiled once per variant with kvroute renamed (ab_ingest.sh):
// AB_NS is that namespace, AB_RUN the function's name. Stores every payload into a fresh
// Index (DecodeBatch, then Index::Apply per event, as Router::ApplyPayload does, with the
// Router's default caps; decode_only: DecodeBatch alone) and returns the seconds it took;
// *blocks: the blocks stored (decoded).
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "events/decoder.h"
#include "index/index.h"
#include "payloads.h"

double AB_RUN(const std::vector<Payload>& ps, uint32_t workers, bool decode_only,
              uint64_t* blocks) {
  AB_NS::IndexOptions o;
  o.max_blocks_per_worker = uint64_t{1} << 22;  // kvroute.Router's defaults
  o.max_blocks_total = uint64_t{1} << 25;
  AB_NS::Index ix(o);
  for (uint32_t i = 0; i < workers; ++i) ix.AddWorker();
  const AB_NS::DecodeLimits limits;
  AB_NS::EventBatch batch;
  AB_NS::DropCounts drops;
  AB_NS::ApplyCounts counts;
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t decoded = 0;
  for (const Payload& p : ps) {
    AB_NS::DecodeBatch(p.bytes.data(), p.bytes.size(), limits, &batch, &drops);
    for (const auto& ev : batch.events) {
      if (decode_only) {
        decoded += ev.block_hashes.size();
      } else {
        ix.Apply(p.worker, ev, &counts);
      }
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  *blocks = decode_only ? decoded : counts.blocks_stored;
  return std::chrono::duration<double>(t1 - t0).count();
}
