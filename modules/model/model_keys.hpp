// The deck section [model]: the transformer's shape and initialisation (MODEL.md), declared
// and checked where the model is assembled.
#pragma once

#include "io/deck_schema.hpp"

namespace kmoe {

deck::DeckSection model_deck_section();  // [model]

}  // namespace kmoe
