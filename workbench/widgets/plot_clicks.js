// Clicks on the plotly plots of the dashboard this widget sits in, sent to Python as `clicked`.
// The plots come and go (a panel's output is replaced when its points change), so the plots are
// looked for a few times a second and each new one gets its listener once.
const titleOf = (gd) => {
  const title = gd.layout && gd.layout.title;
  return (title && (title.text ?? title)) || "";
};

export default {
  render({ model, el }) {
    el.classList.add("wb-plot-clicks");
    el.style.cssText = "font:12px sans-serif;color:#666";
    const draw = () => { el.textContent = model.get("hint"); };
    const hooked = new WeakSet();
    const hook = () => {
      const root = el.closest(".wb-dashboard");
      if (!root) return;
      for (const gd of root.querySelectorAll(".js-plotly-plot")) {
        if (hooked.has(gd) || typeof gd.on !== "function") continue;  // not drawn yet: next time
        hooked.add(gd);
        gd.classList.add("wb-clickable");
        gd.on("plotly_click", (event) => {
          const point = event && event.points && event.points[0];
          // The dashboard gives every point its step as customdata: the x axis may be cost, not steps.
          const step = typeof point?.customdata === "number" ? point.customdata : point?.x;
          if (typeof step !== "number") return;
          const n = (model.get("clicked").n || 0) + 1;
          model.set("clicked", {title: titleOf(gd), trace: (point.data && point.data.name) || "", step, n});
          model.save_changes();
        });
      }
    };
    draw();
    hook();
    const timer = setInterval(hook, 300);
    model.on("change:hint", draw);
    return () => { clearInterval(timer); model.off("change:hint", draw); };
  },
};
