#include "server/request_stream.h"

#include <algorithm>

namespace kvlm::server {

namespace {
bool contains(const std::vector<TokenId>& v, TokenId t) { return std::ranges::find(v, t) != v.end(); }
}  // namespace

bool RequestStream::is_stop_token(TokenId t) const { return contains(opts_.stop_token_ids, t) || contains(opts_.eos_token_ids, t); }

RequestStream::RequestStream(const Tokenizer* tok, TextOptions opts, int num_choices) : tok_(tok), opts_(std::move(opts)) {
  choices_.reserve(size_t(num_choices));
  for (int i = 0; i < num_choices; ++i) {
    Choice c;
    if (tok_ && !opts_.pooling) c.text.emplace(*tok_, opts_.stop, opts_.skip_special_tokens);
    if (opts_.pooling) c.pooler.emplace(opts_.pooling->type, opts_.pooling->width);
    choices_.push_back(std::move(c));
  }
}

// The end of a choice's text: what the decoder and the stop matcher still hold.
void RequestStream::finish_text(Choice& c, ChoiceEvent& ev) {
  if (!c.text) return;
  ev.text += c.text->finish();
  if (c.text->stopped()) {
    ev.reason = FinishReason::Stop;
    ev.stop_string = c.text->matched();
    ev.stop_token.reset();
    if (opts_.include_stop_str_in_output) ev.text += c.text->matched();
  }
}

bool RequestStream::on_output(int choice, const RequestOutput& out) noexcept {
  bool keep_going = true;
  try {
    std::lock_guard lock(mu_);
    if (choice < 0 || choice >= int(choices_.size())) return false;
    Choice& c = choices_[size_t(choice)];
    if (c.finished) return false;  // finished here already (a stop string): the engine's echo of it
    ChoiceEvent ev;
    ev.choice = choice;
    ev.prompt_logprobs = out.prompt_logprobs;
    if (c.pooler && !out.prompt_logits.empty()) c.pooler->add(out.prompt_logits, out.prompt_logits_begin);
    const bool stopped_by_token = out.finished && out.finish_reason == FinishReason::Stop;
    for (size_t i = 0; i < out.new_tokens.size(); ++i) {
      const TokenId t = out.new_tokens[i];
      ++c.completion_tokens;
      ev.tokens.push_back(t);
      if (i < out.new_logprobs.size()) ev.logprobs.push_back(out.new_logprobs[i]);
      if (!c.text) continue;
      // The token that ended the choice (EOS or a stop token) is not part of its text.
      const bool last = i + 1 == out.new_tokens.size();
      if (last && stopped_by_token && !opts_.include_stop_str_in_output && is_stop_token(t)) continue;
      ev.text += c.text->push(t);
      if (c.text->stopped()) {
        keep_going = false;
        break;
      }
    }
    if (!keep_going) {
      ev.finished = true;
      ev.reason = FinishReason::Stop;
      ev.stop_string = c.text->matched();
      if (opts_.include_stop_str_in_output) ev.text += c.text->matched();
    } else if (out.finished) {
      ev.finished = true;
      ev.reason = out.finish_reason == FinishReason::None ? FinishReason::Stop : out.finish_reason;
      ev.error = out.error;
      if (ev.reason == FinishReason::Stop && !out.new_tokens.empty()) {
        const TokenId t = out.new_tokens.back();
        // vLLM reports the stop token in stop_reason, except the model's own EOS.
        if (contains(opts_.stop_token_ids, t)) ev.stop_token = t;
      }
      if (ev.reason == FinishReason::Stop || ev.reason == FinishReason::Length) finish_text(c, ev);
      if (c.pooler && (ev.reason == FinishReason::Stop || ev.reason == FinishReason::Length)) {  // the prompt ran
        if (c.pooler->rows_seen() == 0) {
          ev.reason = FinishReason::Error;
          ev.error = "the engine returned no hidden states for the input";
        } else {
          ev.embedding = c.pooler->finish(opts_.pooling->normalize, opts_.pooling->dimensions);
        }
      }
    }
    ev.prompt_tokens = out.prompt_tokens;
    ev.cached_tokens = out.cached_prompt_tokens;
    ev.completion_tokens = c.completion_tokens;
    if (ev.finished) {
      c.finished = true;
      ++finished_;
    }
    const bool worth = ev.finished || !ev.text.empty() || !ev.tokens.empty() || !ev.prompt_logprobs.empty();
    if (worth) events_.push_back(std::move(ev));
  } catch (...) {
    // Out of memory, most likely: end this choice as an error rather than the engine.
    std::lock_guard lock(mu_);
    if (choice >= 0 && choice < int(choices_.size()) && !choices_[size_t(choice)].finished) {
      choices_[size_t(choice)].finished = true;
      ++finished_;
      ChoiceEvent ev;
      ev.choice = choice;
      ev.finished = true;
      ev.reason = FinishReason::Error;
      ev.error = "the server could not process the model's output";
      try {
        events_.push_back(std::move(ev));
      } catch (...) {
      }
    }
    keep_going = false;
  }
  cv_.notify_all();
  return keep_going;
}

void RequestStream::fail(int choice, FinishReason reason, const std::string& error) {
  {
    std::lock_guard lock(mu_);
    if (choice < 0 || choice >= int(choices_.size())) return;
    Choice& c = choices_[size_t(choice)];
    if (c.finished) return;
    c.finished = true;
    ++finished_;
    ChoiceEvent ev;
    ev.choice = choice;
    ev.finished = true;
    ev.reason = reason;
    ev.error = error;
    ev.completion_tokens = c.completion_tokens;
    events_.push_back(std::move(ev));
  }
  cv_.notify_all();
}

void RequestStream::wait(std::vector<ChoiceEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  for (auto& e : events_) out.push_back(std::move(e));
  events_.clear();
}

bool RequestStream::done() const {
  std::lock_guard lock(mu_);
  return finished_ == int(choices_.size()) && events_.empty();
}

bool RequestStream::all_finished() const {
  std::lock_guard lock(mu_);
  return finished_ == int(choices_.size());
}

}  // namespace kvlm::server
