/* Structured output's token index: every token of a vocabulary walked through a byte automaton from one state.

   The walk follows the vocabulary's trie (its tokens' prefixes in depth-first order), so tokens that share a prefix
   walk it once, and a prefix that leaves the automaton skips its whole subtree: from a state that allows a few
   bytes, a few nodes are visited; from one inside a JSON string, most of them. */

#include <stdint.h>

#define MAX_DEPTH 256

/* next [states, 256] (-1: no match can follow); node n of the trie: its last byte, its depth (1 for the root's
   children), skip[n] (the node after its subtree), and the tokens ending there: ids[first[n] .. first[n + 1]).
   -> how many tokens are allowed from `state`, their ids in out_ids[] and their next states in out_states[]. */
int token_walk(const int32_t* next, int state, const uint8_t* byte, const int32_t* depth, const int32_t* skip,
               const int32_t* first, const int32_t* ids, int nodes, int32_t* out_ids, int32_t* out_states)
{
  int32_t at[MAX_DEPTH + 1]; /* at[d]: the state after the first d bytes of the current path */
  at[0] = state;
  int count = 0;
  for (int n = 0; n < nodes;) {
    const int d = depth[n];
    const int32_t q = next[(int64_t)at[d - 1] * 256 + byte[n]];
    if (q < 0) {
      n = skip[n];
      continue;
    }
    at[d] = q;
    for (int k = first[n]; k < first[n + 1]; k++) {
      out_ids[count] = ids[k];
      out_states[count] = q;
      count++;
    }
    n++;
  }
  return count;
}
