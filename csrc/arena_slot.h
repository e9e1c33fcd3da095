// The check every host pass over the sequences' arena makes of a row's slot.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace specengine {

// Throws std::invalid_argument ("<pass>: row r has slot s outside the arena's n") unless
// 0 <= slot < num_slots.
inline void check_arena_slot(const char* pass, int64_t row, int64_t slot, int64_t num_slots) {
  if (slot < 0 || slot >= num_slots) {
    throw std::invalid_argument(std::string(pass) + ": row " + std::to_string(row) +
                                " has slot " + std::to_string(slot) + " outside the arena's " +
                                std::to_string(num_slots));
  }
}

}  // namespace specengine
