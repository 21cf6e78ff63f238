// A tiny test harness shared by the native test drivers in cpp/tests/ (no framework).
//
//   TEST(name) { CHECK(...); CHECK_EQ(a, b); CHECK_THROWS(expr, type); }
//   int main(int argc, char** argv) { return kvroute_test::RunTests(argc, argv, {}); }
//
// RunTests runs every registered test (or those whose name contains an argument), prints one
// PASS/FAIL line per test and a last line "N passed, M failed", and returns 0 only if all
// passed. `modes` maps a flag (e.g. "--bench") to a function run instead of the tests.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace kvroute_test {

inline int g_checks_failed_in_test = 0;

struct TestCase {
  const char* name;
  void (*fn)();
};
inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> r;
  return r;
}
struct Registrar {
  Registrar(const char* name, void (*fn)()) { Registry().push_back({name, fn}); }
};

inline double Secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int RunTests(int argc, char** argv,
                    const std::vector<std::pair<const char*, int (*)()>>& modes) {
  std::vector<std::string> filters;
  for (int i = 1; i < argc; ++i) {
    for (const auto& [flag, fn] : modes) {
      if (std::strcmp(argv[i], flag) == 0) return fn();
    }
    filters.emplace_back(argv[i]);
  }
  int passed = 0, failed = 0;
  for (const TestCase& t : Registry()) {
    if (!filters.empty() &&
        std::none_of(filters.begin(), filters.end(),
                     [&](const std::string& f) { return std::strstr(t.name, f.c_str()); })) {
      continue;
    }
    g_checks_failed_in_test = 0;
    const double t0 = Secs();
    try {
      t.fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "  uncaught exception: %s\n", e.what());
      ++g_checks_failed_in_test;
    }
    const bool ok = g_checks_failed_in_test == 0;
    std::printf("%s %s (%.2fs)\n", ok ? "PASS" : "FAIL", t.name, Secs() - t0);
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace kvroute_test

#define TEST(name)                                                  \
  void Test_##name();                                               \
  const kvroute_test::Registrar registrar_##name(#name, &Test_##name); \
  void Test_##name()

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      ++kvroute_test::g_checks_failed_in_test;                                        \
      std::fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                                 \
  } while (0)

#define CHECK_EQ(a, b)                                                                  \
  do {                                                                                  \
    const auto va_ = (a);                                                               \
    const auto vb_ = (b);                                                               \
    if (!(va_ == vb_)) {                                                                \
      ++kvroute_test::g_checks_failed_in_test;                                          \
      std::fprintf(stderr, "  %s:%d: CHECK_EQ failed: %s == %s (%s vs %s)\n", __FILE__, \
                   __LINE__, #a, #b, std::to_string(va_).c_str(),                      \
                   std::to_string(vb_).c_str());                                        \
    }                                                                                   \
  } while (0)

#define CHECK_THROWS(expr, type)                                                         \
  do {                                                                                   \
    bool thrown_ = false;                                                                \
    try {                                                                                \
      (void)(expr);                                                                      \
    } catch (const type&) {                                                              \
      thrown_ = true;                                                                    \
    } catch (...) {                                                                      \
    }                                                                                    \
    if (!thrown_) {                                                                      \
      ++kvroute_test::g_checks_failed_in_test;                                           \
      std::fprintf(stderr, "  %s:%d: expected %s from %s\n", __FILE__, __LINE__, #type, \
                   #expr);                                                               \
    }                                                                                    \
  } while (0)

// Stops the enclosing bool function at its first failure (one failure can cascade).
#define REQUIRE(cond, ...)                                                              \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      ++kvroute_test::g_checks_failed_in_test;                                          \
      std::fprintf(stderr, "  %s:%d: REQUIRE failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                \
      std::fprintf(stderr, "\n");                                                       \
      return false;                                                                     \
    }                                                                                   \
  } while (0)
