// Live refresh and confirmations. Optional: every page reads and every form works without it.
"use strict";

(function () {
  var source = document.body.getAttribute("data-live-source");
  var state = document.querySelector("[data-live-state]");
  var busy = false;
  var again = false;

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Outbox-Live": "1" }, credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (old) {
          var replacement = fresh.getElementById(old.id);
          if (replacement) { old.replaceWith(document.importNode(replacement, true)); }
        });
        document.dispatchEvent(new CustomEvent("outbox:refreshed"));
      })
      .catch(function () { if (state) { state.classList.add("stale"); } })
      .finally(function () {
        busy = false;
        if (again) { again = false; refresh(); }
      });
  }

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
