#include "scoring/params.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace kvroute {
namespace {

std::string Show(const ParamValue& v) {
  std::ostringstream s;
  if (const bool* b = std::get_if<bool>(&v)) {
    s << (*b ? "true" : "false");
  } else if (const int64_t* i = std::get_if<int64_t>(&v)) {
    s << *i;
  } else {
    s << std::get<double>(v);
  }
  return s.str();
}

// "in [lo, hi]" or ">= lo" (hi unbounded), as kvroute.policies words it.
std::string Range(const ParamSpec& k) {
  const bool unbounded = k.type == ParamType::kInt ? std::get<int64_t>(k.hi) == kIntMax
                                                   : std::isinf(std::get<double>(k.hi));
  if (unbounded) return ">= " + Show(k.lo);
  return "in [" + Show(k.lo) + ", " + Show(k.hi) + "]";
}

const ParamValue& Get(const ParamValues& v, const char* name) {
  auto it = v.find(name);
  if (it == v.end()) throw std::logic_error(std::string("no policy knob ") + name);
  return it->second;
}

}  // namespace

const char* ParamTypeName(ParamType t) {
  switch (t) {
    case ParamType::kBool:
      return "bool";
    case ParamType::kInt:
      return "int";
    case ParamType::kFloat:
      return "float";
  }
  return "?";
}

ParamValues ResolveParams(const std::string& policy, const std::vector<ParamSpec>& schema,
                          const ParamValues& given) {
  ParamValues out;
  for (const ParamSpec& k : schema) out[k.name] = k.def;
  for (const auto& [name, value] : given) {
    auto it = out.find(name);
    if (it == out.end()) {
      std::string names;
      for (const ParamSpec& k : schema) names += (names.empty() ? "" : ", ") + std::string(k.name);
      throw std::invalid_argument(policy + ": unknown parameter " + name + "; its parameters: " +
                                  (names.empty() ? "none" : names));
    }
    const ParamSpec* k = nullptr;
    for (const ParamSpec& s : schema) {
      if (name == s.name) k = &s;
    }
    const std::string where = policy + ": " + name + " must be ";
    switch (k->type) {
      case ParamType::kBool:
        if (!std::holds_alternative<bool>(value)) {
          throw std::invalid_argument(where + "true or false, got " + Show(value));
        }
        it->second = value;
        break;
      case ParamType::kInt: {
        const int64_t* i = std::get_if<int64_t>(&value);
        if (i == nullptr || *i < std::get<int64_t>(k->lo) || *i > std::get<int64_t>(k->hi)) {
          throw std::invalid_argument(where + "an int " + Range(*k) + ", got " + Show(value));
        }
        it->second = *i;
        break;
      }
      case ParamType::kFloat: {
        double d = std::nan("");
        if (const double* p = std::get_if<double>(&value)) d = *p;
        if (const int64_t* p = std::get_if<int64_t>(&value)) d = static_cast<double>(*p);
        if (!(d >= std::get<double>(k->lo) && d <= std::get<double>(k->hi))) {
          throw std::invalid_argument(where + "a number " + Range(*k) + ", got " + Show(value));
        }
        it->second = d;
        break;
      }
    }
  }
  return out;
}

double FloatParam(const ParamValues& v, const char* name) {
  const ParamValue& x = Get(v, name);
  if (!std::holds_alternative<double>(x)) {
    throw std::logic_error(std::string("policy knob ") + name + " is not a float");
  }
  return std::get<double>(x);
}

int64_t IntParam(const ParamValues& v, const char* name) {
  const ParamValue& x = Get(v, name);
  if (!std::holds_alternative<int64_t>(x)) {
    throw std::logic_error(std::string("policy knob ") + name + " is not an int");
  }
  return std::get<int64_t>(x);
}

bool BoolParam(const ParamValues& v, const char* name) {
  const ParamValue& x = Get(v, name);
  if (!std::holds_alternative<bool>(x)) {
    throw std::logic_error(std::string("policy knob ") + name + " is not a bool");
  }
  return std::get<bool>(x);
}

}  // namespace kvroute
