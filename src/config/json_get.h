// Typed access to JSON fields with errors that name the file and the field, instead of
// nlohmann's "type must be number, but is string".
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kvlm::json_get {

inline std::string type_name(const nlohmann::json& v) { return v.type_name(); }

// Returns nullopt when the key is absent or null.
inline const nlohmann::json* find(const nlohmann::json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline std::optional<long long> opt_int(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  const auto* v = find(obj, key);
  if (!v) return std::nullopt;
  if (v->is_number_integer() || v->is_number_unsigned()) return v->get<long long>();
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d == static_cast<double>(static_cast<long long>(d))) return static_cast<long long>(d);
  }
  throw Error(std::string(where) + ": field '" + std::string(key) + "' must be an integer, got " +
              type_name(*v) + " " + v->dump());
}

inline std::optional<double> opt_number(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  const auto* v = find(obj, key);
  if (!v) return std::nullopt;
  if (v->is_number()) return v->get<double>();
  throw Error(std::string(where) + ": field '" + std::string(key) + "' must be a number, got " + type_name(*v));
}

inline std::optional<bool> opt_bool(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  const auto* v = find(obj, key);
  if (!v) return std::nullopt;
  if (v->is_boolean()) return v->get<bool>();
  throw Error(std::string(where) + ": field '" + std::string(key) + "' must be true or false, got " + type_name(*v));
}

inline std::optional<std::string> opt_string(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  const auto* v = find(obj, key);
  if (!v) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  throw Error(std::string(where) + ": field '" + std::string(key) + "' must be a string, got " + type_name(*v));
}

inline long long req_int(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  auto v = opt_int(obj, key, where);
  if (!v) throw Error(std::string(where) + ": required field '" + std::string(key) + "' is missing");
  return *v;
}

}  // namespace kvlm::json_get
