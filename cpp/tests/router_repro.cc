// Reproducers of two Router races, run by hand (not by ctest), under TSan or ASan:
//
//   router_repro remove-close   Router::RemoveWorker racing Router::Close
//   router_repro add-close      the AddWorker / Close lock-order deadlock (a watchdog exits 3)
//
// Built with the native tests (-DKVROUTE_NATIVE_TESTS=ON), e.g. build/tsan/router_repro.
#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "router/router.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

RouterOptions Opts() {
  RouterOptions o;
  o.ingest_threads = 1;
  o.seed = 7;
  return o;
}
WorkerConfig Wc(std::string name, std::string endpoint) {
  WorkerConfig w;
  w.name = std::move(name);
  w.endpoint = std::move(endpoint);
  w.dp_rank = -1;
  return w;
}

// Router::RemoveWorker reads `subscriber_` without a lock while Router::Close() moves it out
// and destroys the Subscriber. Run under TSan (data race) or ASan (use-after-free, rarely).
int ReproRemoveClose() {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  for (int i = 0; i < 50; ++i) {
    Router r(Opts(), {Wc("z", ep)});
    std::atomic<int> ready{0};
    std::thread t1([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.RemoveWorker("z");
    });
    std::thread t2([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.Close();
    });
    t1.join();
    t2.join();
  }
  std::printf("repro finished without a sanitizer report\n");
  return 0;
}

// Router::AddWorker (endpoint set) locks workers_mu_ then close_mu_; Router::Close locks
// close_mu_ then workers_mu_. Concurrent calls can deadlock: a watchdog reports it.
int ReproAddClose() {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  std::atomic<int> done_iters{0};
  std::thread watchdog([&] {
    int last = -1;
    while (done_iters.load() < 2000) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      const int now = done_iters.load();
      if (now == last && now < 2000) {
        std::printf("DEADLOCK: AddWorker/Close stuck at iteration %d\n", now);
        std::fflush(stdout);
        std::_Exit(3);
      }
      last = now;
    }
  });
  for (int i = 0; i < 2000; ++i) {
    Router r(Opts(), {});
    std::atomic<int> ready{0};
    std::thread t1([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      try {
        r.AddWorker(Wc("z", ep));
      } catch (const std::logic_error&) {
      }
    });
    std::thread t2([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.Close();
    });
    t1.join();
    t2.join();
    done_iters.fetch_add(1);
  }
  watchdog.join();
  std::printf("repro finished: no deadlock in 2000 iterations\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "remove-close") == 0) return ReproRemoveClose();
  if (argc == 2 && std::strcmp(argv[1], "add-close") == 0) return ReproAddClose();
  std::fprintf(stderr, "usage: %s {remove-close|add-close}\n", argv[0]);
  return 2;
}
