// Live refresh and confirmations. Optional: every page reads and every form works without it.
"use strict";

(function () {
  var source = document.body.getAttribute("data-live-source");
  var state = document.querySelector("[data-live-state]");
  var busy = false;
  var again = false;
  var held = false;  // a section was left as it was because someone is filling in a form there

  // An operator typing a reason or ticking messages must not lose it to a live update:
  // such a section waits until its fields are as the page drew them and none has the focus.
  function changed(field) {
    if (field.tagName === "SELECT") {
      return Array.prototype.some.call(field.options, function (o) { return o.selected !== o.defaultSelected; });
    }
    if (field.type === "checkbox" || field.type === "radio") { return field.checked !== field.defaultChecked; }
    return field.value !== field.defaultValue;
  }

  function editing(section) {
    var focused = document.activeElement;
    if (focused && section.contains(focused) && focused.matches("input, textarea, select")) { return true; }
    return Array.prototype.some.call(section.querySelectorAll("input:not([type=hidden]), textarea, select"), changed);
  }

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Outbox-Live": "1" }, credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        held = false;
        document.querySelectorAll("[data-live][id]").forEach(function (old) {
          var replacement = fresh.getElementById(old.id);
          if (!replacement) { return; }
          if (editing(old)) { held = true; return; }
          old.replaceWith(document.importNode(replacement, true));
        });
        document.dispatchEvent(new CustomEvent("outbox:refreshed", { detail: { held: held } }));
      })
      .catch(function () { if (state) { state.classList.add("stale"); } })
      .finally(function () {
        busy = false;
        if (again) { again = false; refresh(); }
      });
  }

  // Once the fields are back as drawn and left, the section catches up with what it missed.
  document.addEventListener("focusout", function () {
    if (held) { setTimeout(function () { if (held) { refresh(); } }, 0); }
  });

  if (source && window.EventSource) {
    var events = new EventSource(source);
    events.addEventListener("update", refresh);
    events.addEventListener("open", function () { if (state) { state.classList.remove("stale"); } });
    events.addEventListener("error", function () { if (state) { state.classList.add("stale"); } });
  }

  // A list's count is its own request (it may read many rows): fetch it after the page.
  function fillCounts() {
    document.querySelectorAll("[data-count-src]").forEach(function (slot) {
      fetch(slot.getAttribute("data-count-src"), { credentials: "same-origin" })
        .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
        .then(function (html) {
          var found = new DOMParser().parseFromString(html, "text/html").querySelector("[data-count=matching]");
          if (found) {
            slot.textContent = found.textContent;
            slot.removeAttribute("data-count-src");
            slot.setAttribute("data-count", "matching");
          }
        })
        .catch(function () { /* the link stays */ });
    });
  }
  fillCounts();
  document.addEventListener("outbox:refreshed", fillCounts);

  // A bulk action with "selected" scope needs a selection: say so before a round trip.
  var bulk = document.getElementById("bulk");
  if (bulk) {
    bulk.addEventListener("submit", function (event) {
      var scope = bulk.querySelector("input[name=scope]:checked");
      var picked = document.querySelectorAll("input[name=id][form=bulk]:checked").length;
      if (scope && scope.value === "selected" && picked === 0) {
        event.preventDefault();
        window.alert("Select at least one message, or choose \u201call matching the filter\u201d.");
      }
    });
  }
})();
