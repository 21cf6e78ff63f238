// Policy knobs. Each policy declares its own in its own file: a schema (ParamSpec: name, type,
// default, range, doc) in its PolicyDef (policy.h), read into the policy's own struct when the
// policy is built and when Router::SetPolicy reconfigures it (Policy::Configure): once per
// change, never per decision. A policy and its fallback each hold their own values, so two
// knobs of the same name (kv_aware's and lmcache_aware's cache_weight, a consistent_hash
// policy's and its consistent_hash fallback's virtual_nodes) never meet.
//
// The schema is what validates (ResolveParams) and what Python reads (_core.policy_schema():
// kvroute.policies and kvroute.config.policy are checked against it at import).
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace kvroute {

enum class ParamType { kBool, kInt, kFloat };
const char* ParamTypeName(ParamType t);  // "bool", "int", "float"

using ParamValue = std::variant<bool, int64_t, double>;
// Knob name -> value. Given to MakePolicy / Router: the knobs set (the others take their
// defaults); from ResolveParams: every knob of the schema.
using ParamValues = std::map<std::string, ParamValue>;

constexpr double kNoUpperBound = std::numeric_limits<double>::infinity();
constexpr int64_t kIntMax = std::numeric_limits<int64_t>::max();

// One knob. def, lo and hi hold the knob's type (lo / hi: an inclusive range; unused for
// kBool); an unbounded float has hi = kNoUpperBound, an unbounded int hi = kIntMax.
struct ParamSpec {
  const char* name;
  ParamType type;
  ParamValue def;
  ParamValue lo;
  ParamValue hi;
  const char* doc;
};

inline ParamSpec FloatKnob(const char* name, double def, double lo, double hi, const char* doc) {
  return {name, ParamType::kFloat, def, lo, hi, doc};
}
inline ParamSpec IntKnob(const char* name, int64_t def, int64_t lo, int64_t hi, const char* doc) {
  return {name, ParamType::kInt, def, lo, hi, doc};
}
inline ParamSpec BoolKnob(const char* name, bool def, const char* doc) {
  return {name, ParamType::kBool, def, false, true, doc};
}

// Every knob of `schema`: `given` over the defaults; an int given for a float knob becomes a
// float. Throws std::invalid_argument "<policy>: ..." naming an unknown knob (and the policy's
// knobs), a value of the wrong type, or one out of range (and the range).
ParamValues ResolveParams(const std::string& policy, const std::vector<ParamSpec>& schema,
                          const ParamValues& given);

// A knob of resolved values (ResolveParams) as its type. Throws std::logic_error when absent
// or of another type: a policy reading a knob its schema does not declare (a bug).
double FloatParam(const ParamValues& v, const char* name);
int64_t IntParam(const ParamValues& v, const char* name);
bool BoolParam(const ParamValues& v, const char* name);

}  // namespace kvroute
